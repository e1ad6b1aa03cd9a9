//! The x86-64 kernels behind [`super`]: AVX-512 and AVX2 + FMA, one macro for all five
//! (instruction set × weight type, and AVX-512 BF16's bf16 × bf16), differing only in their
//! load and multiply-add helpers.

use super::{dot_bf16, dot_bf16_pairs, dot_f32};
pub use bf16::{has_bf16_dot, to_bf16_bits};
use bf16::{mac512_bf16, w512_bf16, x512_bf16, zero512_bf16};
use std::arch::x86_64::*;

/// How many weights ahead of the loads the kernels ask for memory to be fetched (8 KB of f32,
/// 4 KB of bf16). The hardware prefetcher alone left a quarter of the bandwidth unused:
/// SmolLM-135M decode went from 24.6 to 29.8 tok/s in f32 and from 32.2 to 43.4 in bf16
/// (medians of alternating runs; 0, 4, 8 and 16 KB ahead were tried).
const PREFETCH_AHEAD: usize = 2048;

/// Rows of x per block: a block of x (64 × K) stays in L2 while every weight row of the
/// caller's slice passes once, from memory, through a tile.
const M_BLOCK: usize = 64;

/// A tiled kernel. `$tile::<MR>` keeps 4 weight rows × MR x rows of sums in
/// registers: each step loads `$elems` weights of every weight row once (`$load_w`) and
/// the same columns of every x row once (`$load_x`), and multiplies all pairs (`$mac`).
/// The sums are reduced across lanes by `$reduce4`, four at once, and the last
/// `k % $elems` columns go to `$tail`. `$gemm` covers x and w with tiles of
/// at most 4 × `$mr`, and one row of x (decode) a weight row at a time (`$row`).
macro_rules! tiled {
    ($gemm:ident, $tile:ident, $row:ident, $xty:ty, $wty:ty, $feat:literal, $elems:expr, $mr:expr,
     $acc_zero:expr, $w_zero:expr, $load_x:ident, $load_w:ident, $mac:ident,
     $reduce4:ident, $tail:ident) => {
        /// # Safety
        /// As for `super::rows_f32_strided`, and `n + 4`, `m + MR` are within w and x.
        #[target_feature(enable = $feat)]
        #[allow(clippy::needless_range_loop)] // const-bound index loops become registers
        unsafe fn $tile<const MR: usize>(
            x: &[$xty],
            k: usize,
            w: &[$wty],
            (n, m): (usize, usize),
            y: *mut f32,
            ldy: usize,
        ) {
            const NR: usize = 4;
            let body = k - k % $elems;
            let (xp, wp) = (x.as_ptr(), w.as_ptr());
            let mut acc = [[$acc_zero; MR]; NR];
            let mut wv = [$w_zero; NR];
            let mut i = 0;
            while i < body {
                // SAFETY: i + $elems <= body <= k, n + a < rows of w and m + b < rows
                // of x, so every load is inside w or x.
                for a in 0..NR {
                    wv[a] = $load_w(wp.add((n + a) * k + i));
                }
                for b in 0..MR {
                    let xv = $load_x(xp.add((m + b) * k), k, i);
                    for a in 0..NR {
                        acc[a][b] = $mac(acc[a][b], wv[a], xv);
                    }
                }
                i += $elems;
            }
            // The 4 sums of one x row are neighbours in y: they reduce together.
            for b in 0..MR {
                let mut sums = [0f32; NR];
                let r = |a: usize| acc[a][b];
                _mm_storeu_ps(sums.as_mut_ptr(), $reduce4(r(0), r(1), r(2), r(3)));
                for a in 0..NR {
                    if body < k {
                        let xr = &x[(m + b) * k..(m + b + 1) * k];
                        sums[a] += $tail(xr, &w[(n + a) * k..(n + a + 1) * k], body);
                    }
                    // SAFETY: the caller vouches for this place in y.
                    *y.add((m + b) * ldy + n + a) = sums[a];
                }
            }
        }

        /// One weight row against one x row, with four sums over interleaved steps so that
        /// the multiply-adds' latency does not bound the read of the one stream.
        ///
        /// # Safety
        /// As `$tile`, for weight row `n` and x row `m`.
        #[target_feature(enable = $feat)]
        unsafe fn $row(
            x: &[$xty],
            k: usize,
            w: &[$wty],
            (n, m): (usize, usize),
            y: *mut f32,
            ldy: usize,
        ) {
            let body = k - k % $elems;
            let (xp, wp) = (x.as_ptr().add(m * k), w.as_ptr().add(n * k));
            let mut acc = [$acc_zero; 4];
            let mut i = 0;
            // SAFETY (every load): at most body <= k columns, in row n of w and row m of x.
            while i + 4 * $elems <= body {
                for u in 0..4 {
                    let at = i + u * $elems;
                    acc[u] = $mac(acc[u], $load_w(wp.add(at)), $load_x(xp, k, at));
                }
                i += 4 * $elems;
            }
            while i < body {
                acc[0] = $mac(acc[0], $load_w(wp.add(i)), $load_x(xp, k, i));
                i += $elems;
            }
            let mut sums = [0f32; 4];
            _mm_storeu_ps(sums.as_mut_ptr(), $reduce4(acc[0], acc[1], acc[2], acc[3]));
            let mut sum = (sums[0] + sums[1]) + (sums[2] + sums[3]);
            if body < k {
                sum += $tail(&x[m * k..(m + 1) * k], &w[n * k..(n + 1) * k], body);
            }
            // SAFETY: the caller vouches for this place in y.
            *y.add(m * ldy + n) = sum;
        }

        /// # Safety
        /// As for `super::rows_f32_strided`.
        #[target_feature(enable = $feat)]
        pub unsafe fn $gemm(x: &[$xty], k: usize, w: &[$wty], y: *mut f32, ldy: usize) {
            let (rows_x, rows_w) = (x.len() / k, w.len() / k);
            for m0 in (0..rows_x).step_by(M_BLOCK) {
                let m1 = (m0 + M_BLOCK).min(rows_x);
                let mut n = 0;
                while n < rows_w {
                    let mut m = m0;
                    // SAFETY (every call): n + 4 <= rows_w and m + MR <= m1 <= rows_x, or
                    // row n of w and row m of x for `$row`.
                    // One row of x (decode) goes a weight row at a time, one stream read in
                    // order: with four rows at once the hardware prefetcher followed four
                    // short streams badly (Zen 4, SmolLM2-135M bf16 decode, 1 thread: 43
                    // tok/s through the 4-row tile, 76 through `$row`).
                    if n + 4 <= rows_w && rows_x > 1 {
                        // Tiles of $mr x rows, then of 4 where $mr is more, and a tail of 1-3
                        // in one tile; with tiles of 4, nine rows (MLA's heads over one
                        // latent) as 3 + 3 + 3 rather than 4 + 4 + 1.
                        let thirds =
                            $mr == 4 && !(m1 - m).is_multiple_of(4) && (m1 - m).is_multiple_of(3);
                        while m < m1 {
                            let step = match m1 - m {
                                left if thirds => left.min(3),
                                left if left >= $mr => $mr,
                                left if left >= 4 => 4,
                                left => left,
                            };
                            match step {
                                4 => $tile::<4>(x, k, w, (n, m), y, ldy),
                                3 => $tile::<3>(x, k, w, (n, m), y, ldy),
                                2 => $tile::<2>(x, k, w, (n, m), y, ldy),
                                1 => $tile::<1>(x, k, w, (n, m), y, ldy),
                                _ => $tile::<$mr>(x, k, w, (n, m), y, ldy),
                            }
                            m += step;
                        }
                        n += 4;
                    } else {
                        for m in m..m1 {
                            $row(x, k, w, (n, m), y, ldy);
                        }
                        n += 1;
                    }
                }
            }
        }
    };
}

/// Asks for the cache line [`PREFETCH_AHEAD`] weights past `p` (address arithmetic only).
#[inline(always)]
fn prefetch<T>(p: *const T) {
    // SAFETY: a prefetch is a hint: it never faults, whatever the address.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_AHEAD) as *const i8) }
}

// AVX-512, f32: 16 weights per step.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn w512_f32(w: *const f32) -> __m512 {
    prefetch(w);
    // SAFETY: the kernel guarantees 16 readable f32 at w.
    unsafe { _mm512_loadu_ps(w) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn x512_f32(x: *const f32, _k: usize, i: usize) -> __m512 {
    // SAFETY: the kernel calls this with i + 16 <= k.
    unsafe { _mm512_loadu_ps(x.add(i)) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
fn mac512_f32(acc: __m512, w: __m512, x: __m512) -> __m512 {
    _mm512_fmadd_ps(w, x, acc)
}

// AVX-512, bf16: 32 weights (16 pairs) per step, as (low, high) halves of each pair,
// against the 16 even and 16 odd x values of the same columns.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn w512_pairs(w: *const u16) -> (__m512, __m512) {
    prefetch(w);
    // SAFETY: the kernel guarantees 32 readable u16 at w; the rest is register-only.
    unsafe {
        let v = _mm512_loadu_si512(w as *const __m512i);
        let lo = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v));
        let hi = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(-65536)));
        (lo, hi)
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn x512_pairs(xp: *const f32, k: usize, i: usize) -> (__m512, __m512) {
    // SAFETY: the kernel calls this with i + 32 <= k, so i/2 + 16 <= k/2 <= ceil(k/2).
    unsafe {
        let odd = xp.add(k.div_ceil(2));
        (
            _mm512_loadu_ps(xp.add(i / 2)),
            _mm512_loadu_ps(odd.add(i / 2)),
        )
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
fn mac512_pairs(acc: __m512, (lo, hi): (__m512, __m512), (ev, od): (__m512, __m512)) -> __m512 {
    _mm512_fmadd_ps(hi, od, _mm512_fmadd_ps(lo, ev, acc))
}

// AVX2: the same with 8 lanes.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn w256_f32(w: *const f32) -> __m256 {
    prefetch(w);
    // SAFETY: the kernel guarantees 8 readable f32 at w.
    unsafe { _mm256_loadu_ps(w) }
}

#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn x256_f32(x: *const f32, _k: usize, i: usize) -> __m256 {
    // SAFETY: the kernel calls this with i + 8 <= k.
    unsafe { _mm256_loadu_ps(x.add(i)) }
}

#[target_feature(enable = "avx2,fma")]
#[inline]
fn mac256_f32(acc: __m256, w: __m256, x: __m256) -> __m256 {
    _mm256_fmadd_ps(w, x, acc)
}

#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn w256_pairs(w: *const u16) -> (__m256, __m256) {
    prefetch(w);
    // SAFETY: the kernel guarantees 16 readable u16 at w; the rest is register-only.
    unsafe {
        let v = _mm256_loadu_si256(w as *const __m256i);
        let lo = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v));
        let hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(-65536)));
        (lo, hi)
    }
}

#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn x256_pairs(xp: *const f32, k: usize, i: usize) -> (__m256, __m256) {
    // SAFETY: the kernel calls this with i + 16 <= k, so i/2 + 8 <= k/2 <= ceil(k/2).
    unsafe {
        let odd = xp.add(k.div_ceil(2));
        (
            _mm256_loadu_ps(xp.add(i / 2)),
            _mm256_loadu_ps(odd.add(i / 2)),
        )
    }
}

#[target_feature(enable = "avx2,fma")]
#[inline]
fn mac256_pairs(acc: __m256, (lo, hi): (__m256, __m256), (ev, od): (__m256, __m256)) -> __m256 {
    _mm256_fmadd_ps(hi, od, _mm256_fmadd_ps(lo, ev, acc))
}

/// The lane sums of four vectors, as one: `[Σa, Σb, Σc, Σd]`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
fn sum4_512(a: __m512, b: __m512, c: __m512, d: __m512) -> __m128 {
    // Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3], then [Σa, Σb, Σc, Σd].
    let ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    let cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    let (ab, cd) = (_mm512_castps_pd(ab), _mm512_castps_pd(cd));
    let lanes = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(ab, cd)),
        _mm512_castpd_ps(_mm512_unpackhi_pd(ab, cd)),
    );
    // The four 128-bit lanes added together (moved as f64 pairs, added as f32).
    let high = _mm512_extractf64x4_pd::<1>(_mm512_castps_pd(lanes));
    let half = _mm256_add_ps(_mm512_castps512_ps256(lanes), _mm256_castpd_ps(high));
    _mm_add_ps(
        _mm256_castps256_ps128(half),
        _mm256_extractf128_ps::<1>(half),
    )
}

/// [`sum4_512`] for 8 lanes.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn sum4_256(a: __m256, b: __m256, c: __m256, d: __m256) -> __m128 {
    let t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps::<1>(t))
}

// AVX-512 tiles are 4 × 6 for f32 and bf16 × bf16 (24 sums, 4 weight registers, 1 for x, of
// 32), 4 × 4 for bf16 widened in registers (16 sums, 8 weight registers, 2 for x). On Zen 4
// (2 threads, `probe_rows_throughput`, 64 x rows), 4 × 4 -> 4 × 6: bf16 × bf16 against the
// 1.7B shape's 2048 × 2048, 8192 × 2048 and 2048 × 8192 weights 286, 292, 252 -> 346, 354,
// 316 GFLOP/s, SmolLM2's 1536 × 576 and 576 × 1536 the same (300-358); f32 against 8192 ×
// 2048 157-159 -> 190-193 (1 thread 80 -> 96, of 117 the FMAs allow). Blocking k (x's rows
// cut to 1-8 KB, the tiles adding their sums into y) measured no better.
// AVX2 tiles are 4 × 2 (8 sums, 4 weight registers, 1 or 2 for x, of 16): on the Zen 3 host
// a 4 × 3 tile spills and ran slower than 4 × 1, 4 × 2 ran 1.3-2× faster than 4 × 1 at 4-40
// rows of x (Qwen2.5-1.5B's matrices). Prompts of many rows go to `prefill` instead.
#[rustfmt::skip]
tiled!(f32_avx512, tile_f32_avx512, row_f32_avx512, f32, f32, "avx512f,avx512bw,avx512vl",
    16, 6, _mm512_setzero_ps(), _mm512_setzero_ps(), x512_f32, w512_f32, mac512_f32,
    sum4_512, dot_f32);
#[rustfmt::skip]
tiled!(bf16_avx512, tile_bf16_avx512, row_bf16_avx512, f32, u16, "avx512f,avx512bw,avx512vl",
    32, 4, _mm512_setzero_ps(), (_mm512_setzero_ps(), _mm512_setzero_ps()), x512_pairs,
    w512_pairs, mac512_pairs, sum4_512, dot_bf16);
#[rustfmt::skip]
tiled!(bf16_dot_avx512, tile_bf16_dot_avx512, row_bf16_dot_avx512, u16, u16,
    "avx512f,avx512bw,avx512vl,avx512bf16", 32, 6, _mm512_setzero_ps(), zero512_bf16(),
    x512_bf16, w512_bf16, mac512_bf16, sum4_512, dot_bf16_pairs);
#[rustfmt::skip]
tiled!(f32_avx2, tile_f32_avx2, row_f32_avx2, f32, f32, "avx2,fma", 8, 2,
    _mm256_setzero_ps(), _mm256_setzero_ps(), x256_f32, w256_f32, mac256_f32,
    sum4_256, dot_f32);
#[rustfmt::skip]
tiled!(bf16_avx2, tile_bf16_avx2, row_bf16_avx2, f32, u16, "avx2,fma", 16, 2,
    _mm256_setzero_ps(), (_mm256_setzero_ps(), _mm256_setzero_ps()), x256_pairs,
    w256_pairs, mac256_pairs, sum4_256, dot_bf16);

mod bf16;
