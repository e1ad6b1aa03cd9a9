//! [`super`]'s tile kernel on AVX2 (and, compiled again with AVX-512VL's 32 registers, a
//! larger tile on AVX-512 CPUs).
//!
//! For a tile of RW weight rows, one group ([`super::group`]) is decoded once, then every
//! RX rows of x run through it (Q8_0 with the sign trick): per weight row, x row and chunk,
//! `maddubs` + `madd` (2 integer µops for 32 products), then for a K-quant an integer add
//! (x has one scale per superblock, as the weight row's `d`: both are applied once per
//! group), for the other formats a conversion and an FMA by `d·dx`. Every format's minimums
//! are applied once per group, into an f32 vector per (x row, weight row) kept in memory
//! across the groups.

use super::super::kquant::x86::{Q2K, Q3K, Q4K, Q5K, Q5_0, Q5_1, Q6K};
use super::super::{Format, QRows, QWeight, BLOCK};
use super::group::{close, decode, group_chunks, half_masks, store, Group, Q4_0, Q4_1, Q8_0};
use std::arch::x86_64::*;

/// Rows `r0..r1` of `y (M, w.rows) = x · wᵀ`, every row of x.
///
/// # Safety
/// AVX2, FMA and F16C; `r0 <= r1 <= w.rows`; `x` holds M rows of `w`'s width; `y` is valid
/// for writes at `i · w.rows + r` for i < M and r0 <= r < r1, which nothing else touches
/// meanwhile; `w`'s blocks match its shape.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn rows<const RW: usize, const RX: usize>(
    w: &QWeight,
    (r0, r1): (usize, usize),
    x: &QRows,
    y: *mut f32,
) {
    // SAFETY: the caller's.
    unsafe {
        match w.format {
            Format::Q8_0 => rows_in::<Q8_0, RW, RX>(w, (r0, r1), x, y),
            Format::Q4_0 => rows_in::<Q4_0, RW, RX>(w, (r0, r1), x, y),
            Format::Q4_1 => rows_in::<Q4_1, RW, RX>(w, (r0, r1), x, y),
            Format::Q5_0 => rows_in::<Q5_0, RW, RX>(w, (r0, r1), x, y),
            Format::Q5_1 => rows_in::<Q5_1, RW, RX>(w, (r0, r1), x, y),
            Format::Q2K => rows_in::<Q2K, RW, RX>(w, (r0, r1), x, y),
            Format::Q3K => rows_in::<Q3K, RW, RX>(w, (r0, r1), x, y),
            Format::Q4K => rows_in::<Q4K, RW, RX>(w, (r0, r1), x, y),
            Format::Q5K => rows_in::<Q5K, RW, RX>(w, (r0, r1), x, y),
            Format::Q6K => rows_in::<Q6K, RW, RX>(w, (r0, r1), x, y),
        }
    }
}

/// [`rows`] on AVX-512 CPUs: the same code given 32 vector registers (AVX-512VL), for a
/// larger tile.
///
/// # Safety
/// As [`rows`], and the CPU has AVX-512F, BW and VL.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub unsafe fn rows_512<const RW: usize, const RX: usize>(
    w: &QWeight,
    r: (usize, usize),
    x: &QRows,
    y: *mut f32,
) {
    // SAFETY: the caller's.
    unsafe {
        match w.format {
            Format::Q8_0 => rows_in::<Q8_0, RW, RX>(w, r, x, y),
            Format::Q4_0 => rows_in::<Q4_0, RW, RX>(w, r, x, y),
            Format::Q4_1 => rows_in::<Q4_1, RW, RX>(w, r, x, y),
            Format::Q5_0 => rows_in::<Q5_0, RW, RX>(w, r, x, y),
            Format::Q5_1 => rows_in::<Q5_1, RW, RX>(w, r, x, y),
            Format::Q2K => rows_in::<Q2K, RW, RX>(w, r, x, y),
            Format::Q3K => rows_in::<Q3K, RW, RX>(w, r, x, y),
            Format::Q4K => rows_in::<Q4K, RW, RX>(w, r, x, y),
            Format::Q5K => rows_in::<Q5K, RW, RX>(w, r, x, y),
            Format::Q6K => rows_in::<Q6K, RW, RX>(w, r, x, y),
        }
    }
}

/// [`rows`] for one format and tile shape.
///
/// # Safety
/// As [`rows`].
// The tile's loops index the accumulators, the decoded rows and x's rows together.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn rows_in<const F: u8, const RW: usize, const RX: usize>(
    w: &QWeight,
    (r0, r1): (usize, usize),
    x: &QRows,
    y: *mut f32,
) {
    let m = x.quants.len() / w.cols;
    let g = group_chunks(w);
    let (groups, xblocks) = (w.cols / BLOCK / g, w.cols / BLOCK);
    // A K-quant's d is the same for the group's chunks: applied once per group.
    let uniform = matches!(F, Q2K | Q3K | Q4K | Q5K | Q6K);
    let mut totals = vec![_mm256_setzero_ps(); m * RW];
    let mut tile = [Group::zero(); RW];
    let masks = half_masks(g);
    for rt in (r0..r1).step_by(RW) {
        totals.fill(_mm256_setzero_ps());
        for gi in 0..groups {
            for (k, group) in tile.iter_mut().enumerate() {
                // A tail tile repeats its last row; only real rows are written out.
                // SAFETY: the row exists; gi < groups.
                unsafe { decode::<F>(w, (rt + k).min(r1 - 1), gi, g, group) };
            }
            for i0 in (0..m).step_by(RX) {
                let mut acc = [[_mm256_setzero_ps(); RX]; RW];
                let mut dots = [[_mm256_setzero_si256(); RX]; RW];
                for c in 0..g {
                    for j in 0..RX {
                        let xb = (i0 + j).min(m - 1) * xblocks + gi * g + c;
                        // SAFETY: block xb of x exists (rows of w's width).
                        let (xv, dx) = unsafe {
                            (
                                _mm256_loadu_si256(
                                    x.quants.as_ptr().add(xb * BLOCK) as *const __m256i
                                ),
                                _mm256_broadcast_ss(x.scales.get_unchecked(xb)),
                            )
                        };
                        for k in 0..RW {
                            let q = tile[k].quants[c];
                            let (u, s) = match F {
                                Q8_0 => (_mm256_sign_epi8(q, q), _mm256_sign_epi8(xv, q)),
                                _ => (q, xv),
                            };
                            let d =
                                _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), tile[k].scales[c]);
                            if uniform {
                                // One scale for the superblock, x's too: summed in integers.
                                dots[k][j] = _mm256_add_epi32(dots[k][j], d);
                            } else {
                                let scale = _mm256_mul_ps(dx, tile[k].d[c]);
                                acc[k][j] =
                                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), scale, acc[k][j]);
                            }
                        }
                    }
                }
                for j in 0..RX.min(m - i0) {
                    let i = i0 + j;
                    let t = &mut totals[i * RW..(i + 1) * RW];
                    // Loops, not `map`: a closure is compiled without this function's target
                    // features, and its vectors would go through memory.
                    let (mut a, mut d) = ([_mm256_setzero_ps(); RW], [_mm256_setzero_si256(); RW]);
                    for k in 0..RW {
                        (a[k], d[k]) = (acc[k][j], dots[k][j]);
                    }
                    // SAFETY: group gi of row i < m exists.
                    unsafe { close::<F, RW>(t, &tile, x, i * xblocks + gi * g, g, &masks, a, d) };
                }
            }
        }
        // SAFETY: the caller's.
        unsafe { store::<RW>(&totals, (rt, r1), w.rows, y) };
    }
}
