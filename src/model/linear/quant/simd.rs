//! One row of a block-format weight against one Q8_0 row of x: AVX2 (+ FMA) where the CPU
//! has it (`Isa`), a scalar loop elsewhere (aarch64 too, until a NEON `vdotq_s32` form).

use super::{Format, QRows, QWeight, BLOCK};

/// `Σ_b d_w[b] · d_x[b] · Σ_j w[b, j] · x[b, j]` over the blocks of weight row `r` and row
/// `i` of x.
pub fn dot(w: &QWeight, r: usize, x: &QRows, i: usize) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::model::linear::simd::{Isa, IsaKind};
        if matches!(Isa::current().kind(), IsaKind::Avx2 | IsaKind::Avx512) {
            // SAFETY: Isa::current() says this CPU has AVX2 and FMA.
            return unsafe { x86::dot(w, r, x, i) };
        }
    }
    scalar(w, r, x, i)
}

fn scalar(w: &QWeight, r: usize, x: &QRows, i: usize) -> f32 {
    let blocks = w.cols / BLOCK;
    (0..blocks)
        .map(|b| {
            let (wb, xb) = (r * blocks + b, i * blocks + b);
            let xs = &x.quants[xb * BLOCK..(xb + 1) * BLOCK];
            let sum: i32 = match w.format {
                Format::Q8_0 => w.quants[wb * BLOCK..(wb + 1) * BLOCK]
                    .iter()
                    .zip(xs)
                    .map(|(&a, &b)| a as i8 as i32 * b as i32)
                    .sum(),
                Format::Q4_0 => {
                    let q = &w.quants[wb * BLOCK / 2..(wb + 1) * BLOCK / 2];
                    (0..BLOCK / 2)
                        .map(|j| {
                            let (lo, hi) = ((q[j] & 0x0F) as i32 - 8, (q[j] >> 4) as i32 - 8);
                            lo * xs[j] as i32 + hi * xs[j + BLOCK / 2] as i32
                        })
                        .sum()
                }
            };
            w.scales[wb].to_f32() * x.scales[xb] * sum as f32
        })
        .sum()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Format, QRows, QWeight, BLOCK};
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX2 and FMA; `r` and `i` are rows of `w` and `x`, which have the same width.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(w: &QWeight, r: usize, x: &QRows, i: usize) -> f32 {
        let blocks = w.cols / BLOCK;
        debug_assert_eq!(x.cols, w.cols);
        let mut acc = _mm256_setzero_ps();
        let xq = x.quants[i * w.cols..(i + 1) * w.cols].as_ptr();
        let xd = &x.scales[i * blocks..(i + 1) * blocks];
        let wd = &w.scales[r * blocks..(r + 1) * blocks];
        for b in 0..blocks {
            // SAFETY: block b of row i of x is 32 readable bytes.
            let xv = unsafe { _mm256_loadu_si256(xq.add(b * BLOCK) as *const __m256i) };
            let wv = match w.format {
                // SAFETY: block b of weight row r is 32 bytes of quants.
                Format::Q8_0 => unsafe {
                    _mm256_loadu_si256(
                        w.quants.as_ptr().add((r * blocks + b) * BLOCK) as *const __m256i
                    )
                },
                // SAFETY: 16 bytes of nibbles; low nibbles are weights 0-15, high 16-31.
                Format::Q4_0 => unsafe {
                    let p = w.quants.as_ptr().add((r * blocks + b) * BLOCK / 2);
                    let v = _mm_loadu_si128(p as *const __m128i);
                    let both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
                    let nibbles = _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
                    _mm256_sub_epi8(nibbles, _mm256_set1_epi8(8))
                },
            };
            // llama.cpp's mul_sum_i8_pairs: |w| · sign(w)·x as unsigned × signed pairs,
            // summed to 16 then 32 bits.
            let ax = _mm256_sign_epi8(wv, wv);
            let sy = _mm256_sign_epi8(xv, wv);
            let pairs = _mm256_maddubs_epi16(ax, sy);
            let sums = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
            let d = _mm256_set1_ps(wd[b].to_f32() * xd[b]);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), d, acc);
        }
        // Horizontal sum of the 8 lanes.
        let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }
}
