//! Row kernels for one slice of a matrix-vector product: `y[r] = Σ_k x[k] · W[r, k]` for the
//! rows of `w` (row-major, width `k`), with f32 weights or bf16 weights (raw `u16` bits,
//! widened to f32 in registers). Three instruction sets, chosen once at run time: AVX-512
//! (f + bw + vl), AVX2 + FMA, and a portable scalar loop. Accumulation is always in f32.
//!
//! bf16 weights are read in pairs: a 32-bit lane holding `W[r, 2i]` (low half) and
//! `W[r, 2i+1]` (high half) is two f32 values after one shift and one mask, with no
//! widening shuffle. So the bf16 kernels take `x` in [`pair_layout`]: its even-indexed
//! values, then its odd-indexed ones, split once per product instead of once per row.

/// The instruction set the kernels run with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Avx512,
    Avx2,
    Scalar,
}

impl Isa {
    /// [`Isa::detect`], once per process.
    pub fn current() -> Isa {
        static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *ISA.get_or_init(Isa::detect)
    }

    /// The best set this CPU supports.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
            {
                return Isa::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    }
}

/// How many weights ahead of the loads the kernels ask for memory to be fetched (8 KB of f32,
/// 4 KB of bf16). The hardware prefetcher alone left a quarter of the bandwidth unused:
/// SmolLM-135M decode went from 24.6 to 29.8 tok/s in f32 and from 32.2 to 43.4 in bf16
/// (medians of alternating runs; 0, 4, 8 and 16 KB ahead were tried).
const PREFETCH_AHEAD: usize = 2048;

/// Widens bf16 bits to f32 (exact: bf16 is the top half of an f32).
#[inline(always)]
fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// `x` rearranged for [`rows_bf16`]: `x[0], x[2], x[4], ..` then `x[1], x[3], ..`.
pub fn pair_layout(x: &[f32]) -> Vec<f32> {
    x.iter()
        .step_by(2)
        .chain(x.iter().skip(1).step_by(2))
        .copied()
        .collect()
}

/// `x[j]` read from its [`pair_layout`] `xp` (the even values come first, `ceil(k / 2)`).
#[inline(always)]
fn paired(xp: &[f32], j: usize) -> f32 {
    match j % 2 {
        0 => xp[j / 2],
        _ => xp[xp.len().div_ceil(2) + j / 2],
    }
}

/// `y (M, R) = x (M, K) · wᵀ` for f32 `w` (R, K), every operand dense and row-major.
pub fn rows_f32(isa: Isa, x: &[f32], k: usize, w: &[f32], y: &mut [f32]) {
    let r = check_shapes(x.len(), k, w.len(), y.len());
    // SAFETY: `check_shapes` proved y holds M·R values, so every write at m·R + r is inside.
    unsafe { rows_f32_strided(isa, x, k, w, y.as_mut_ptr(), r) }
}

/// [`rows_f32`] for bf16 `w` (raw bits), with each row of `x` in [`pair_layout`].
pub fn rows_bf16(isa: Isa, xp: &[f32], k: usize, w: &[u16], y: &mut [f32]) {
    let r = check_shapes(xp.len(), k, w.len(), y.len());
    // SAFETY: as in `rows_f32`.
    unsafe { rows_bf16_strided(isa, xp, k, w, y.as_mut_ptr(), r) }
}

/// Panics unless x is M rows and w is R rows of width k and y is M·R; returns R.
fn check_shapes(x: usize, k: usize, w: usize, y: usize) -> usize {
    let ok = k > 0 && x.is_multiple_of(k) && w.is_multiple_of(k) && y == (x / k) * (w / k);
    assert!(
        ok,
        "x ({x}) and w ({w}) are not rows of width {k} making y ({y})"
    );
    w / k
}

/// `y[m·ldy + r] = Σ_j x[m·K + j] · w[r·K + j]` for every row m of x and r of w: the form
/// a parallel caller uses to write its own columns of a shared output.
///
/// # Safety
/// `x.len()` and `w.len()` are multiples of `k > 0`, `y` is valid for writes at every
/// `m·ldy + r` above and nothing else touches those places meanwhile, and `isa` is
/// supported by this CPU (it is whenever it came from [`Isa::detect`]).
pub unsafe fn rows_f32_strided(isa: Isa, x: &[f32], k: usize, w: &[f32], y: *mut f32, ldy: usize) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract is the kernel's.
        Isa::Avx512 => unsafe { x86::f32_avx512(x, k, w, y, ldy) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { x86::f32_avx2(x, k, w, y, ldy) },
        // SAFETY: as above.
        _ => unsafe { rows_scalar(x, k, w, y, ldy, dot_f32) },
    }
}

/// [`rows_f32_strided`] for bf16 weights and x rows in [`pair_layout`].
///
/// # Safety
/// As for [`rows_f32_strided`].
pub unsafe fn rows_bf16_strided(
    isa: Isa,
    xp: &[f32],
    k: usize,
    w: &[u16],
    y: *mut f32,
    ldy: usize,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract is the kernel's.
        Isa::Avx512 => unsafe { x86::bf16_avx512(xp, k, w, y, ldy) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { x86::bf16_avx2(xp, k, w, y, ldy) },
        // SAFETY: as above.
        _ => unsafe { rows_scalar(xp, k, w, y, ldy, dot_bf16) },
    }
}

/// Whether `isa` keeps a tile of several x rows in registers (AVX-512's 32 registers hold
/// 4 weight rows × 4 x rows), so that a product of many rows reads `w` once per 64 rows.
/// Elsewhere each row of x is a pass over `w`, and candle's GEMM is the better choice.
pub fn tiles_rows(isa: Isa) -> bool {
    isa == Isa::Avx512
}

/// The portable path: one dot product per (row of x, row of w).
///
/// # Safety
/// As for [`rows_f32_strided`].
unsafe fn rows_scalar<W>(
    x: &[f32],
    k: usize,
    w: &[W],
    y: *mut f32,
    ldy: usize,
    dot: fn(&[f32], &[W], usize) -> f32,
) {
    for (m, xr) in x.chunks_exact(k).enumerate() {
        for (r, wr) in w.chunks_exact(k).enumerate() {
            // SAFETY: the caller vouches for every m·ldy + r.
            unsafe { *y.add(m * ldy + r) = dot(xr, wr, 0) };
        }
    }
}

/// `Σ x[j] · row[j]` for `j >= from`, with eight independent sums so the adds can overlap.
fn dot_f32(x: &[f32], row: &[f32], from: usize) -> f32 {
    let (x, row) = (&x[from..], &row[from..]);
    let mut acc = [0f32; 8];
    let (xb, wb) = (x.chunks_exact(8), row.chunks_exact(8));
    let tail: f32 = xb
        .remainder()
        .iter()
        .zip(wb.remainder())
        .map(|(a, b)| a * b)
        .sum();
    for (xc, wc) in xb.zip(wb) {
        for j in 0..8 {
            acc[j] = wc[j].mul_add(xc[j], acc[j]);
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// [`dot_f32`] for a bf16 row and x in [`pair_layout`], pair by pair.
fn dot_bf16(xp: &[f32], row: &[u16], from: usize) -> f32 {
    let k = row.len();
    let (even, odd) = xp.split_at(k.div_ceil(2));
    let mut acc = [0f32; 8];
    let pairs = (from.div_ceil(2)..k / 2)
        .map(|i| (i, bf16_to_f32(row[2 * i]), bf16_to_f32(row[2 * i + 1])));
    for (i, lo, hi) in pairs {
        acc[i % 8] = lo.mul_add(even[i], hi.mul_add(odd[i], acc[i % 8]));
    }
    // An odd `from` starts on a pair's high half, an odd `k` ends on a lone low half.
    let first = if from % 2 == 1 {
        bf16_to_f32(row[from]) * paired(xp, from)
    } else {
        0.0
    };
    let last = if k % 2 == 1 && from < k {
        bf16_to_f32(row[k - 1]) * even[k / 2]
    } else {
        0.0
    };
    acc.iter().sum::<f32>() + first + last
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{dot_bf16, dot_f32, PREFETCH_AHEAD};
    use std::arch::x86_64::*;

    /// Rows of x per block: a block of x (64 × K) stays in L2 while every weight row of the
    /// caller's slice passes once, from memory, through a tile.
    const M_BLOCK: usize = 64;

    /// A tiled kernel. `$tile::<NR, MR>` keeps NR weight rows × MR x rows of sums in
    /// registers: each step loads `$elems` weights of every weight row once (`$load_w`) and
    /// the same columns of every x row once (`$load_x`), and multiplies all pairs (`$mac`).
    /// The last `k % $elems` columns go to `$tail`. `$gemm` covers x and w with tiles of
    /// at most 4 × `$mr`.
    macro_rules! tiled {
        ($gemm:ident, $tile:ident, $wty:ty, $feat:literal, $elems:expr, $mr:expr,
         $acc_zero:expr, $w_zero:expr, $load_x:ident, $load_w:ident, $mac:ident,
         $reduce:ident, $tail:ident) => {
            /// # Safety
            /// As for `super::rows_f32_strided`, and `n + NR`, `m + MR` are within w and x.
            #[target_feature(enable = $feat)]
            #[allow(clippy::needless_range_loop)] // const-bound index loops become registers
            unsafe fn $tile<const NR: usize, const MR: usize>(
                x: &[f32],
                k: usize,
                w: &[$wty],
                (n, m): (usize, usize),
                y: *mut f32,
                ldy: usize,
            ) {
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
                for a in 0..NR {
                    for b in 0..MR {
                        let mut sum = $reduce(acc[a][b]);
                        if body < k {
                            let xr = &x[(m + b) * k..(m + b + 1) * k];
                            sum += $tail(xr, &w[(n + a) * k..(n + a + 1) * k], body);
                        }
                        // SAFETY: the caller vouches for this place in y.
                        *y.add((m + b) * ldy + n + a) = sum;
                    }
                }
            }

            /// # Safety
            /// As for `super::rows_f32_strided`.
            #[target_feature(enable = $feat)]
            pub unsafe fn $gemm(x: &[f32], k: usize, w: &[$wty], y: *mut f32, ldy: usize) {
                let (rows_x, rows_w) = (x.len() / k, w.len() / k);
                for m0 in (0..rows_x).step_by(M_BLOCK) {
                    let m1 = (m0 + M_BLOCK).min(rows_x);
                    let mut n = 0;
                    while n < rows_w {
                        let mut m = m0;
                        // SAFETY (every call): n + NR <= rows_w and m + MR <= m1 <= rows_x.
                        if n + 4 <= rows_w {
                            while m1 - m >= $mr {
                                $tile::<4, $mr>(x, k, w, (n, m), y, ldy);
                                m += $mr;
                            }
                            for m in m..m1 {
                                $tile::<4, 1>(x, k, w, (n, m), y, ldy);
                            }
                            n += 4;
                        } else {
                            for m in m..m1 {
                                $tile::<1, 1>(x, k, w, (n, m), y, ldy);
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

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    fn sum512(v: __m512) -> f32 {
        _mm512_reduce_add_ps(v)
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn sum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    // AVX-512 tiles are 4 × 4 (16 sums, 4 or 8 weight registers, 1 or 2 for x, of 32);
    // AVX2 has 16 registers, so one x row at a time.
    #[rustfmt::skip]
    tiled!(f32_avx512, tile_f32_avx512, f32, "avx512f,avx512bw,avx512vl", 16, 4,
        _mm512_setzero_ps(), _mm512_setzero_ps(), x512_f32, w512_f32, mac512_f32, sum512,
        dot_f32);
    #[rustfmt::skip]
    tiled!(bf16_avx512, tile_bf16_avx512, u16, "avx512f,avx512bw,avx512vl", 32, 4,
        _mm512_setzero_ps(), (_mm512_setzero_ps(), _mm512_setzero_ps()), x512_pairs,
        w512_pairs, mac512_pairs, sum512, dot_bf16);
    #[rustfmt::skip]
    tiled!(f32_avx2, tile_f32_avx2, f32, "avx2,fma", 8, 1,
        _mm256_setzero_ps(), _mm256_setzero_ps(), x256_f32, w256_f32, mac256_f32, sum256,
        dot_f32);
    #[rustfmt::skip]
    tiled!(bf16_avx2, tile_bf16_avx2, u16, "avx2,fma", 16, 1,
        _mm256_setzero_ps(), (_mm256_setzero_ps(), _mm256_setzero_ps()), x256_pairs,
        w256_pairs, mac256_pairs, sum256, dot_bf16);
}
