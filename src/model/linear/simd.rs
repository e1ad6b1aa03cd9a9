//! Row kernels for one slice of a matrix-vector product: `y[r] = Σ_k x[k] · W[r, k]` for the
//! rows of `w` (row-major, width `k`), with f32 weights or bf16 weights (raw `u16` bits,
//! widened to f32 in registers). Three instruction sets, chosen once at run time: AVX-512
//! (f + bw + vl), AVX2 + FMA, and a portable scalar loop. Accumulation is always in f32.

/// The instruction set the kernels run with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Avx512,
    Avx2,
    Scalar,
}

impl Isa {
    /// The best set this CPU supports (detected once; `is_x86_feature_detected!` caches).
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

/// Widens bf16 bits to f32 (exact: bf16 is the top half of an f32).
#[inline(always)]
fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// f32 weights. `w.len()` must equal `y.len() * x.len()`; `isa` must be supported by this CPU
/// (it is whenever it came from [`Isa::detect`]).
pub fn rows_f32(isa: Isa, x: &[f32], w: &[f32], y: &mut [f32]) {
    assert_eq!(
        w.len(),
        y.len() * x.len(),
        "weight slice does not match rows × x"
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's `isa` was detected on this CPU, and the lengths were checked.
        Isa::Avx512 => unsafe { x86::rows_f32_avx512(x, w, y) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { x86::rows_f32_avx2(x, w, y) },
        _ => rows_scalar(x, w, y, |v| v),
    }
}

/// bf16 weights as raw bits. Same contract as [`rows_f32`].
pub fn rows_bf16(isa: Isa, x: &[f32], w: &[u16], y: &mut [f32]) {
    assert_eq!(
        w.len(),
        y.len() * x.len(),
        "weight slice does not match rows × x"
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's `isa` was detected on this CPU, and the lengths were checked.
        Isa::Avx512 => unsafe { x86::rows_bf16_avx512(x, w, y) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { x86::rows_bf16_avx2(x, w, y) },
        _ => rows_scalar(x, w, y, bf16_to_f32),
    }
}

/// The portable path: eight independent accumulators per row so the adds can overlap.
fn rows_scalar<W: Copy>(x: &[f32], w: &[W], y: &mut [f32], widen: impl Fn(W) -> f32) {
    let k = x.len();
    for (row, out) in w.chunks_exact(k.max(1)).zip(y.iter_mut()) {
        let mut acc = [0f32; 8];
        let (xb, wb) = (x.chunks_exact(8), row.chunks_exact(8));
        let (xt, wt) = (xb.remainder(), wb.remainder());
        for (xc, wc) in xb.zip(wb) {
            for j in 0..8 {
                acc[j] = widen(wc[j]).mul_add(xc[j], acc[j]);
            }
        }
        let tail: f32 = xt.iter().zip(wt).map(|(&a, &b)| a * widen(b)).sum();
        *out = acc.iter().sum::<f32>() + tail;
    }
    if k == 0 {
        y.fill(0.0);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// A row kernel over `$lanes`-wide vectors; the last `k % $lanes` columns run scalar.
    macro_rules! row_kernel {
        ($name:ident, $wty:ty, $feat:literal, $lanes:expr, $vec:ty, $zero:expr, $fma:ident,
         $load_x:expr, $load_w:expr, $reduce:expr, $widen:expr) => {
            /// Four rows at a time share each load of `x`; then the remaining rows one by one.
            #[target_feature(enable = $feat)]
            pub unsafe fn $name(x: &[f32], w: &[$wty], y: &mut [f32]) {
                let (k, n) = (x.len(), y.len());
                let body = k - k % $lanes;
                let (xp, wp) = (x.as_ptr(), w.as_ptr());
                let tail =
                    |r: usize| -> f32 { (body..k).map(|i| x[i] * $widen(w[r * k + i])).sum() };
                let mut r = 0;
                while r + 4 <= n {
                    let (mut a0, mut a1, mut a2, mut a3): ($vec, $vec, $vec, $vec) =
                        ($zero, $zero, $zero, $zero);
                    let mut i = 0;
                    while i < body {
                        // SAFETY: i + lanes <= body <= k and r + 3 < n, so every load is
                        // inside x and inside w (whose length is n·k).
                        let xv = $load_x(xp.add(i));
                        a0 = $fma($load_w(wp.add(r * k + i)), xv, a0);
                        a1 = $fma($load_w(wp.add((r + 1) * k + i)), xv, a1);
                        a2 = $fma($load_w(wp.add((r + 2) * k + i)), xv, a2);
                        a3 = $fma($load_w(wp.add((r + 3) * k + i)), xv, a3);
                        i += $lanes;
                    }
                    y[r] = $reduce(a0) + tail(r);
                    y[r + 1] = $reduce(a1) + tail(r + 1);
                    y[r + 2] = $reduce(a2) + tail(r + 2);
                    y[r + 3] = $reduce(a3) + tail(r + 3);
                    r += 4;
                }
                while r < n {
                    let mut a0: $vec = $zero;
                    let mut i = 0;
                    while i < body {
                        // SAFETY: as above, with r < n.
                        a0 = $fma($load_w(wp.add(r * k + i)), $load_x(xp.add(i)), a0);
                        i += $lanes;
                    }
                    y[r] = $reduce(a0) + tail(r);
                    r += 1;
                }
            }
        };
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn ld512_f32(p: *const f32) -> __m512 {
        // SAFETY: the caller guarantees 16 readable f32 at p.
        unsafe { _mm512_loadu_ps(p) }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn ld512_bf16(p: *const u16) -> __m512 {
        // SAFETY: the caller guarantees 16 readable u16 at p; widening is register-only.
        unsafe {
            let h = _mm256_loadu_si256(p as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn ld256_f32(p: *const f32) -> __m256 {
        // SAFETY: the caller guarantees 8 readable f32 at p.
        unsafe { _mm256_loadu_ps(p) }
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn ld256_bf16(p: *const u16) -> __m256 {
        // SAFETY: the caller guarantees 8 readable u16 at p; widening is register-only.
        unsafe {
            let h = _mm_loadu_si128(p as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn sum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    row_kernel!(
        rows_f32_avx512,
        f32,
        "avx512f,avx512bw,avx512vl",
        16,
        __m512,
        _mm512_setzero_ps(),
        _mm512_fmadd_ps,
        ld512_f32,
        ld512_f32,
        _mm512_reduce_add_ps,
        |v: f32| v
    );
    row_kernel!(
        rows_bf16_avx512,
        u16,
        "avx512f,avx512bw,avx512vl",
        16,
        __m512,
        _mm512_setzero_ps(),
        _mm512_fmadd_ps,
        ld512_f32,
        ld512_bf16,
        _mm512_reduce_add_ps,
        super::bf16_to_f32
    );
    row_kernel!(
        rows_f32_avx2,
        f32,
        "avx2,fma",
        8,
        __m256,
        _mm256_setzero_ps(),
        _mm256_fmadd_ps,
        ld256_f32,
        ld256_f32,
        sum256,
        |v: f32| v
    );
    row_kernel!(
        rows_bf16_avx2,
        u16,
        "avx2,fma",
        8,
        __m256,
        _mm256_setzero_ps(),
        _mm256_fmadd_ps,
        ld256_f32,
        ld256_bf16,
        sum256,
        super::bf16_to_f32
    );
}
