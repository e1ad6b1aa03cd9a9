//! Q8_0's row dot product on AVX-512 CPUs with VNNI: two blocks to a 64-byte register, the
//! sign trick by a byte mask (AVX-512 has no 512-bit `vpsignb`), one `vpdpbusd` for the 64
//! products, and both blocks' `d_w·d_x` spread over their halves by one permute. Decode
//! reads every weight once per token, so this is what a Q8_0 file's decode runs on.

use super::super::{QRows, QWeight, BLOCK};
use super::x86::hsum;
use std::arch::x86_64::*;

/// Whether this CPU has the kernel.
pub fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512vnni")
}

/// Q8_0 weight row `r` times row `i` of x.
///
/// # Safety
/// AVX-512F, BW, VL and VNNI, F16C; `w` is Q8_0, `r` one of its rows and `i` a row of `x`, of
/// its width; `w`'s blocks match its shape (`QWeight::product` checks it).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn dot_q8_0(w: &QWeight, r: usize, x: &QRows, i: usize) -> f32 {
    let blocks = w.cols / BLOCK;
    let (wb, xb) = (r * blocks, i * blocks);
    // Lanes 0-7 take the first block's scale, 8-15 the second's.
    let spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    let zero = _mm512_setzero_si512();
    let mut acc = [_mm512_setzero_ps(); 2];
    let mut b = 0;
    while b + 2 <= blocks {
        // SAFETY: blocks b and b + 1 of row r of w and of row i of x exist, with their scales.
        let (wv, xv, dw, dx) = unsafe {
            (
                _mm512_loadu_si512(w.quants.as_ptr().add((wb + b) * BLOCK) as *const _),
                _mm512_loadu_si512(x.quants.as_ptr().add((xb + b) * BLOCK) as *const _),
                _mm_cvtph_ps(_mm_cvtsi32_si128(
                    (w.scales.as_ptr().add(wb + b) as *const i32).read_unaligned(),
                )),
                _mm_castsi128_ps(_mm_loadl_epi64(
                    x.scales.as_ptr().add(xb + b) as *const __m128i
                )),
            )
        };
        // |w| times x with w's sign: unsigned times signed, as `vpdpbusd` takes them.
        let negative = _mm512_movepi8_mask(wv);
        let s = _mm512_mask_sub_epi8(xv, negative, zero, xv);
        let dots = _mm512_dpbusd_epi32(zero, _mm512_abs_epi8(wv), s);
        let scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(dw, dx)));
        acc[b / 2 % 2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), scale, acc[b / 2 % 2]);
        b += 2;
    }
    let sum = _mm512_add_ps(acc[0], acc[1]);
    let mut y = hsum(_mm256_add_ps(
        _mm512_castps512_ps256(sum),
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(sum))),
    ));
    if b < blocks {
        // An odd last block, in 256 bits.
        // SAFETY: block b of row r of w and of row i of x exist.
        let (wv, xv) = unsafe {
            (
                _mm256_loadu_si256(w.quants.as_ptr().add((wb + b) * BLOCK) as *const __m256i),
                _mm256_loadu_si256(x.quants.as_ptr().add((xb + b) * BLOCK) as *const __m256i),
            )
        };
        let dots = _mm256_dpbusd_epi32(
            _mm256_setzero_si256(),
            _mm256_sign_epi8(wv, wv),
            _mm256_sign_epi8(xv, wv),
        );
        let d = w.scales[wb + b].to_f32() * x.scales[xb + b];
        y += d * hsum(_mm256_cvtepi32_ps(dots));
    }
    y
}
