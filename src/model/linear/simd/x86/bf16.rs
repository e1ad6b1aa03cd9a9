//! AVX-512 BF16's pieces of the bf16 × bf16 kernel (`super`'s `bf16_dot_avx512`): x rounded
//! to bf16, and the loads and multiply-add of the tile.

use super::prefetch;
use std::arch::x86_64::*;

// AVX-512 BF16: 32 weights (16 pairs) per step against x's 16 pairs of bf16, both as
// stored; one `vdpbf16ps` multiplies the pairs and adds both products to each f32 lane.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
pub(super) unsafe fn w512_bf16(w: *const u16) -> __m512bh {
    prefetch(w);
    // SAFETY: the kernel guarantees 32 readable u16 at w; both types are 64 bytes of lanes.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(w as *const __m512i)) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
pub(super) unsafe fn x512_bf16(x: *const u16, _k: usize, i: usize) -> __m512bh {
    // SAFETY: the kernel calls this with i + 32 <= k; both types are 64 bytes of lanes.
    unsafe {
        std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(x.add(i) as *const __m512i))
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
pub(super) fn zero512_bf16() -> __m512bh {
    // SAFETY: both types are 64 bytes of lanes; all-zero bits are bf16 zeros.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_setzero_si512()) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
pub(super) fn mac512_bf16(acc: __m512, w: __m512bh, x: __m512bh) -> __m512 {
    _mm512_dpbf16_ps(acc, w, x)
}

/// `x` rounded to bf16 (to nearest, ties to even) as raw bits, 16 at a time
/// (`vcvtneps2bf16`, which also flushes subnormal inputs to zero, as `vdpbf16ps` would
/// treat them; the scalar tail keeps them).
///
/// # Safety
/// The CPU has AVX-512F and BF16 ([`has_bf16_dot`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub unsafe fn to_bf16_bits(x: &[f32]) -> Vec<u16> {
    let mut out = vec![0u16; x.len()];
    let (xs, os) = (x.chunks_exact(16), out.chunks_exact_mut(16));
    for (a, o) in xs.zip(os) {
        // SAFETY: 16 f32 in, 16 u16 (32 bytes) out.
        unsafe {
            let b = _mm512_cvtneps_pbh(_mm512_loadu_ps(a.as_ptr()));
            let b = std::mem::transmute::<__m256bh, __m256i>(b);
            _mm256_storeu_si256(o.as_mut_ptr() as *mut __m256i, b);
        }
    }
    let done = x.len() - x.len() % 16;
    for (o, v) in out[done..].iter_mut().zip(&x[done..]) {
        *o = half::bf16::from_f32(*v).to_bits();
    }
    out
}

/// Whether this CPU has AVX-512 BF16's `vdpbf16ps` (checked once by the standard
/// library's cache).
pub fn has_bf16_dot() -> bool {
    is_x86_feature_detected!("avx512bf16")
}
