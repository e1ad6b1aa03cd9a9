//! [`super`]'s tile kernel on AVX-512 CPUs with VNNI: [`super::group`]'s groups, two chunks
//! to a 64-byte register, and the integer products fused. A 32-weight format's chunk is one
//! `vpdpbusd` (unsigned quants times x's signed bytes, summed by four into 32-bit lanes),
//! then a conversion and an FMA by `d·dx`; Q8_0's signed quants take x's bytes plus 128 as
//! the unsigned side, and start from `−128·Σq` per lane, computed once per weight chunk.
//! A K-quant's chunk is `maddubs`, then `vpdpwssd` (its halves' scales, multiplied and
//! added into the superblock's integer sums). The group's close, minimums included, is
//! [`super::group`]'s, on the two halves of each register added together.

use super::super::kquant::x86::{Q2K, Q3K, Q4K, Q5K, Q5_0, Q5_1, Q6K};
use super::super::{Format, QRows, QWeight, BLOCK};
use super::group::{close, decode, group_chunks, half_masks, store, Group, G, Q4_0, Q4_1, Q8_0};
use std::arch::x86_64::*;

/// Whether this CPU has the VNNI kernel (checked once by the standard library's cache).
pub fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512vnni")
}

/// Rows `r0..r1` of `y (M, w.rows) = x · wᵀ`, every row of x; groups of an odd number of
/// chunks go to [`super::x86::rows_512`].
///
/// # Safety
/// As [`super::x86::rows`], and the CPU has AVX-512F, BW, VL and VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn rows<const RW: usize, const RX: usize>(
    w: &QWeight,
    r: (usize, usize),
    x: &QRows,
    y: *mut f32,
) {
    // SAFETY: the caller's.
    unsafe {
        if group_chunks(w) % 2 == 1 {
            return super::x86::rows_512::<RW, RX>(w, r, x, y);
        }
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

/// Two chunks' 256-bit halves as one register.
#[target_feature(enable = "avx512f")]
#[inline]
fn pair(a: __m256i, b: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b)
}

/// The same for f32 lanes (AVX-512F's 64-bit insert: `insertf32x8` would need DQ).
#[target_feature(enable = "avx512f")]
#[inline]
fn pair_ps(a: __m256, b: __m256) -> __m512 {
    _mm512_castpd_ps(_mm512_insertf64x4::<1>(
        _mm512_castpd256_pd512(_mm256_castps_pd(a)),
        _mm256_castps_pd(b),
    ))
}

/// [`rows`] for one format and tile shape, on groups of an even number of chunks.
///
/// # Safety
/// As [`rows`].
// The tile's loops index the accumulators, the decoded rows and x's rows together.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
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
    let uniform = matches!(F, Q2K | Q3K | Q4K | Q5K | Q6K);
    let mut totals = vec![_mm256_setzero_ps(); m * RW];
    let mut tile = [Group::zero(); RW];
    // Per weight row and pair of chunks: the quants; a K-quant's scales (16-bit lanes) or
    // Q8_0's −128·Σq (32-bit lanes); `d` of each chunk.
    let mut quants = [[_mm512_setzero_si512(); G / 2]; RW];
    let mut extra = [[_mm512_setzero_si512(); G / 2]; RW];
    let mut d = [[_mm512_setzero_ps(); G / 2]; RW];
    let masks = half_masks(g);
    let x128 = _mm512_set1_epi8(-128);
    for rt in (r0..r1).step_by(RW) {
        totals.fill(_mm256_setzero_ps());
        for gi in 0..groups {
            for k in 0..RW {
                let t = &mut tile[k];
                // A tail tile repeats its last row; only real rows are written out.
                // SAFETY: the row exists; gi < groups.
                unsafe { decode::<F>(w, (rt + k).min(r1 - 1), gi, g, t) };
                for p in 0..g / 2 {
                    let q = pair(t.quants[2 * p], t.quants[2 * p + 1]);
                    quants[k][p] = q;
                    extra[k][p] = match F {
                        Q8_0 => _mm512_sub_epi32(
                            _mm512_setzero_si512(),
                            _mm512_dpbusd_epi32(_mm512_setzero_si512(), x128, q),
                        ),
                        _ => pair(t.scales[2 * p], t.scales[2 * p + 1]),
                    };
                    d[k][p] = pair_ps(t.d[2 * p], t.d[2 * p + 1]);
                }
            }
            for i0 in (0..m).step_by(RX) {
                let mut rows = [0; RX];
                for (j, row) in rows.iter_mut().enumerate() {
                    *row = (i0 + j).min(m - 1) * xblocks + gi * g;
                }
                let (acc, dots) = match uniform {
                    // SAFETY: the group's blocks of these rows of x exist.
                    true => ([[_mm256_setzero_ps(); RX]; RW], unsafe {
                        integer::<RW, RX>(&quants, &extra, x, rows, g / 2)
                    }),
                    // SAFETY: as above.
                    false => (
                        unsafe { float::<F, RW, RX>(&quants, &extra, &d, x, rows, g / 2) },
                        [[_mm256_setzero_si256(); RX]; RW],
                    ),
                };
                for j in 0..RX.min(m - i0) {
                    let i = i0 + j;
                    let t = &mut totals[i * RW..(i + 1) * RW];
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

/// A K-quant group's integer sums for RX rows of x (their group's first blocks at `rows`),
/// each folded to 256 bits.
///
/// # Safety
/// AVX-512F, BW, VL and VNNI; `pairs` pairs of blocks of x from each of `rows` exist.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn integer<const RW: usize, const RX: usize>(
    quants: &[[__m512i; G / 2]; RW],
    scales: &[[__m512i; G / 2]; RW],
    x: &QRows,
    rows: [usize; RX],
    pairs: usize,
) -> [[__m256i; RX]; RW] {
    let mut dots = [[_mm512_setzero_si512(); RX]; RW];
    for p in 0..pairs {
        for j in 0..RX {
            // SAFETY: the caller's.
            let xv = unsafe {
                _mm512_loadu_si512(x.quants.as_ptr().add((rows[j] + 2 * p) * BLOCK) as *const _)
            };
            for k in 0..RW {
                let pairs = _mm512_maddubs_epi16(quants[k][p], xv);
                dots[k][j] = _mm512_dpwssd_epi32(dots[k][j], pairs, scales[k][p]);
            }
        }
    }
    // Loops, not `map`: a closure is compiled without this function's target features.
    let mut out = [[_mm256_setzero_si256(); RX]; RW];
    for k in 0..RW {
        for j in 0..RX {
            let d = dots[k][j];
            out[k][j] =
                _mm256_add_epi32(_mm512_castsi512_si256(d), _mm512_extracti64x4_epi64::<1>(d));
        }
    }
    out
}

/// A 32-weight format's group, times `d·dx`, for RX rows of x, each folded to 256 bits.
///
/// # Safety
/// As [`integer`].
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn float<const F: u8, const RW: usize, const RX: usize>(
    quants: &[[__m512i; G / 2]; RW],
    extra: &[[__m512i; G / 2]; RW],
    d: &[[__m512; G / 2]; RW],
    x: &QRows,
    rows: [usize; RX],
    pairs: usize,
) -> [[__m256; RX]; RW] {
    let x128 = _mm512_set1_epi8(-128);
    let mut acc = [[_mm512_setzero_ps(); RX]; RW];
    for p in 0..pairs {
        for j in 0..RX {
            let xb = rows[j] + 2 * p;
            // SAFETY: the caller's.
            let (xv, dx) = unsafe {
                let s = x.scales.as_ptr().add(xb);
                (
                    _mm512_loadu_si512(x.quants.as_ptr().add(xb * BLOCK) as *const _),
                    pair_ps(_mm256_broadcast_ss(&*s), _mm256_broadcast_ss(&*s.add(1))),
                )
            };
            // Q8_0: x + 128, unsigned.
            let xu = _mm512_xor_si512(xv, x128);
            for k in 0..RW {
                let q = quants[k][p];
                let sums = match F {
                    Q8_0 => _mm512_dpbusd_epi32(extra[k][p], xu, q),
                    _ => _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xv),
                };
                let scale = _mm512_mul_ps(dx, d[k][p]);
                acc[k][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc[k][j]);
            }
        }
    }
    let mut out = [[_mm256_setzero_ps(); RX]; RW];
    for k in 0..RW {
        for j in 0..RX {
            let a = acc[k][j];
            out[k][j] = _mm256_add_ps(
                _mm512_castps512_ps256(a),
                _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a))),
            );
        }
    }
    out
}
