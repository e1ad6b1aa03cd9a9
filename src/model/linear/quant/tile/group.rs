//! A tile's group (`super`): G chunks of 32 weights of each of the tile's weight rows, a
//! K-quant's superblock or up to 8 blocks of a 32-weight format, decoded once into
//! registers' worth of memory (each chunk's quants as 32 unsigned bytes, Q8_0's signed; the
//! scales of its two halves as 16-bit lanes for `madd`; its `d`; per half `dmin·m`), and
//! what every tile kernel does with a group's sums: [`close`] (the minimums, and a
//! K-quant's `d·dx`) and [`store`]. The AVX2 kernel (`x86`) and the AVX-512 VNNI one
//! (`vnni`) read the same groups.

use super::super::kquant::x86::{chunk_scales, lanes, quants, Q2K, Q3K, Q4K, Q5K, Q5_0, Q5_1, Q6K};
use super::super::kquant::QK_K;
use super::super::simd::x86::hsum;
use super::super::{QRows, QWeight, BLOCK};
use std::arch::x86_64::*;

pub(super) const Q8_0: u8 = 7;
pub(super) const Q4_0: u8 = 8;
pub(super) const Q4_1: u8 = 9;

/// Chunks in a group at most: a K-quant superblock.
pub(super) const G: usize = QK_K / BLOCK;

/// One weight row's group, decoded.
#[derive(Clone, Copy)]
pub(super) struct Group {
    pub(super) quants: [__m256i; G],
    /// Per chunk: the two halves' scales, each in 8 16-bit lanes.
    pub(super) scales: [__m256i; G],
    /// Per chunk: `d`, in every lane.
    pub(super) d: [__m256; G],
    /// Per half: `dmin · m` (0 for Q8_0, and past the group's 2g halves).
    pub(super) mins: [f32; 2 * G],
}

/// Chunks per group for `w`: a superblock, or the most blocks (up to 8) that divide a row.
pub fn group_chunks(w: &QWeight) -> usize {
    let chunks = w.cols / BLOCK;
    match w.format.block_weights() {
        QK_K => G,
        _ => (1..=G)
            .rev()
            .find(|g| chunks.is_multiple_of(*g))
            .unwrap_or(1),
    }
}

/// Group `gi` of weight row `r`.
///
/// # Safety
/// AVX2; `r` is a row of `w` and `gi` a group of it (of [`group_chunks`] chunks); `w`'s
/// blocks match its shape.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn decode<const F: u8>(
    w: &QWeight,
    r: usize,
    gi: usize,
    g: usize,
    out: &mut Group,
) {
    let chunks = w.cols / BLOCK;
    if matches!(F, Q2K | Q3K | Q4K | Q5K | Q6K) {
        let bytes = w.format.ggml_bytes();
        let at = (r * (w.cols / QK_K) + gi) * bytes;
        let blk = &w.quants[at..at + bytes];
        let s = lanes::<F>(blk);
        out.scales = chunk_scales(s.s);
        for c in 0..G {
            // SAFETY: blk is a whole superblock.
            out.quants[c] = unsafe { quants::<F>(blk.as_ptr(), c) };
            out.d[c] = _mm256_set1_ps(s.d);
        }
        let dmin = _mm256_set1_ps(s.dmin);
        let m =
            |half: __m128i| _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(half)), dmin);
        let mins = out.mins.as_mut_ptr();
        // SAFETY: 16 floats.
        unsafe {
            _mm256_storeu_ps(mins, m(_mm256_castsi256_si128(s.m)));
            _mm256_storeu_ps(mins.add(8), m(_mm256_extracti128_si256::<1>(s.m)));
        }
        return;
    }
    let ones = _mm256_set1_epi16(1);
    out.mins = [0.0; 2 * G];
    for c in 0..g {
        let b = r * chunks + gi * g + c;
        out.scales[c] = ones;
        let (q, d, min) = match F {
            Q5_0 | Q5_1 => {
                let bytes = w.format.ggml_bytes();
                let blk = &w.quants[b * bytes..(b + 1) * bytes];
                let half = |at: usize| half::f16::from_le_bytes([blk[at], blk[at + 1]]).to_f32();
                let d = half(0);
                // Q5_0: w = d·(q − 16), a minimum of 16·d; Q5_1: w = d·q + m.
                let min = if F == Q5_0 { 16.0 * d } else { -half(2) };
                // SAFETY: blk is a whole block.
                (unsafe { quants::<F>(blk.as_ptr(), 0) }, d, min)
            }
            Q8_0 => {
                let p = w.quants[b * BLOCK..(b + 1) * BLOCK].as_ptr();
                // SAFETY: 32 bytes of block b.
                let q = unsafe { _mm256_loadu_si256(p as *const __m256i) };
                (q, w.scales[b].to_f32(), 0.0)
            }
            _ => {
                let p = w.quants[b * BLOCK / 2..(b + 1) * BLOCK / 2].as_ptr();
                // SAFETY: 16 bytes of block b: low nibbles weights 0-15, high 16-31.
                let v = unsafe { _mm_loadu_si128(p as *const __m128i) };
                let q = _mm256_and_si256(
                    _mm256_set_m128i(_mm_srli_epi16(v, 4), v),
                    _mm256_set1_epi8(0x0F),
                );
                let d = w.scales[b].to_f32();
                // Q4_0: w = d·(q − 8); Q4_1: w = d·q + m.
                (
                    q,
                    d,
                    if F == Q4_0 {
                        8.0 * d
                    } else {
                        -w.mins[b].to_f32()
                    },
                )
            }
        };
        out.quants[c] = q;
        out.d[c] = _mm256_set1_ps(d);
        out.mins[2 * c] = min;
        out.mins[2 * c + 1] = min;
    }
}

impl Group {
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) fn zero() -> Group {
        Group {
            quants: [_mm256_setzero_si256(); G],
            scales: [_mm256_setzero_si256(); G],
            d: [_mm256_setzero_ps(); G],
            mins: [0.0; 2 * G],
        }
    }
}

/// Writes a tile's totals (M rows of RW weight rows each) out: column `rt + k` of each row
/// of `y` (`n` columns), for the tile's real rows `rt..r1`.
///
/// # Safety
/// AVX2; `y` is valid for writes at `i · n + rt + k` for i < M and k < min(RW, r1 − rt).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn store<const RW: usize>(
    totals: &[__m256],
    (rt, r1): (usize, usize),
    n: usize,
    y: *mut f32,
) {
    for (i, row) in totals.chunks_exact(RW).enumerate() {
        for (k, &t) in row.iter().enumerate().take(r1 - rt) {
            // SAFETY: row i < M, column rt + k < r1: ours to write (the caller's).
            unsafe { *y.add(i * n + rt + k) = hsum(t) };
        }
    }
}

/// Masks of the first `2g` of a group's 16 half sums, in two vectors of 8 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn half_masks(g: usize) -> [__m256i; 2] {
    let lane = |h: usize| if h < 2 * g { -1 } else { 0 };
    // SAFETY: 8 i32 each.
    unsafe {
        [
            _mm256_loadu_si256(std::array::from_fn::<i32, 8, _>(lane).as_ptr() as *const __m256i),
            _mm256_loadu_si256(
                std::array::from_fn::<i32, 8, _>(|h| lane(8 + h)).as_ptr() as *const __m256i
            ),
        ]
    }
}

/// Adds one x row's share of a group, the tile's weight rows `acc` (f32 sums, already times
/// `d·dx`) or `dots` (a K-quant's integer sums), to its `totals`, with the minimums: `at`
/// is the group's first block of x.
///
/// # Safety
/// AVX2, FMA and F16C; the group's `g` blocks of x from `at` exist; `masks` are
/// [`half_masks`] of `g`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn close<const F: u8, const RW: usize>(
    totals: &mut [__m256],
    tile: &[Group; RW],
    x: &QRows,
    at: usize,
    g: usize,
    masks: &[__m256i; 2],
    acc: [__m256; RW],
    dots: [__m256i; RW],
) {
    let uniform = matches!(F, Q2K | Q3K | Q4K | Q5K | Q6K);
    // The x row's half sums of this group, read where they lie (the lanes past its 2g halves
    // masked off: they are 0, as the minimums there are).
    // SAFETY: 2g halves from block `at` exist; masked lanes are not read. The second eight
    // are only addressed when the group has them (past the end of sums16 the pointer itself
    // would be out of bounds).
    let (s0, s1, dx) = unsafe {
        let p = x.sums16.as_ptr().add(2 * at);
        let s1 = match 2 * g > 8 {
            true => _mm256_maskload_ps(p.add(8), masks[1]),
            false => _mm256_setzero_ps(),
        };
        (
            _mm256_maskload_ps(p, masks[0]),
            s1,
            _mm256_broadcast_ss(x.scales.get_unchecked(at)),
        )
    };
    for k in 0..RW {
        let t = &mut totals[k];
        let mut v = match uniform {
            // One scale for the superblock, x's too: d·dx once.
            true => _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(dots[k]),
                _mm256_mul_ps(dx, tile[k].d[0]),
                *t,
            ),
            false => _mm256_add_ps(acc[k], *t),
        };
        if F != Q8_0 {
            let mins = tile[k].mins.as_ptr();
            // SAFETY: 16 floats.
            unsafe {
                v = _mm256_fnmadd_ps(_mm256_loadu_ps(mins), s0, v);
                v = _mm256_fnmadd_ps(_mm256_loadu_ps(mins.add(8)), s1, v);
            }
        }
        *t = v;
    }
}
