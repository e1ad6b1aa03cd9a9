//! One row of a block-format weight against one Q8_0 row of x: AVX2 (+ FMA) where the CPU
//! has it (`Isa`), NEON on aarch64 (`arm`: `sdot` where the CPU has `dotprod`), a scalar
//! loop elsewhere. Q4_1's minimums add `m_w · d_x · Σ x_q` per block, outside the integer
//! products ([`minimums`]).

use super::{Format, QRows, QWeight, BLOCK};
#[cfg(target_arch = "aarch64")]
use crate::model::linear::simd::{Isa, IsaKind};

/// `Σ_b d_w[b] · d_x[b] · Σ_j w[b, j] · x[b, j]` over the blocks of weight row `r` and row
/// `i` of x (plus [`minimums`]).
pub fn dot(w: &QWeight, r: usize, x: &QRows, i: usize) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::model::linear::simd::{Isa, IsaKind};
        if matches!(Isa::current().kind(), IsaKind::Avx2 | IsaKind::Avx512) {
            // SAFETY: Isa::current() says this CPU has AVX2 and FMA.
            return unsafe { x86::dot(w, r, x, i) } + minimums(w, r, x, i);
        }
    }
    #[cfg(target_arch = "aarch64")]
    if Isa::current().kind() == IsaKind::Neon {
        // SAFETY: r and i are rows of w and x (the caller's loop); NEON is checked (`Isa`).
        return unsafe { arm::dot(w, r, x, i) } + minimums(w, r, x, i);
    }
    scalar(w, r, x, i) + minimums(w, r, x, i)
}

/// `Σ_b m_w[b] · d_x[b] · Σ_j x[b, j]`: what Q4_1's minimums add to a row's dot product (0
/// for the other formats, which have none).
fn minimums(w: &QWeight, r: usize, x: &QRows, i: usize) -> f32 {
    let blocks = w.cols / BLOCK;
    match w.mins.get(r * blocks..(r + 1) * blocks) {
        Some(mins) => (mins.iter().zip(&x.sums[i * blocks..(i + 1) * blocks]))
            .map(|(m, s)| m.to_f32() * s)
            .sum(),
        None => 0.0,
    }
}

/// [`dot`] for rows `i0..i0 + 4` of x: each weight block is loaded (and its nibbles
/// unpacked) once for the four.
pub fn dot4(w: &QWeight, r: usize, x: &QRows, i0: usize) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::model::linear::simd::{Isa, IsaKind};
        if matches!(Isa::current().kind(), IsaKind::Avx2 | IsaKind::Avx512) {
            // SAFETY: as in `dot`; rows i0..i0 + 4 of x exist (the caller's loop).
            let dots = unsafe { x86::dot4(w, r, x, i0) };
            return std::array::from_fn(|j| dots[j] + minimums(w, r, x, i0 + j));
        }
    }
    #[cfg(target_arch = "aarch64")]
    if Isa::current().kind() == IsaKind::Neon {
        // SAFETY: as in `dot`; rows i0..i0 + 4 of x exist (the caller's loop).
        let dots = unsafe { arm::dot4(w, r, x, i0) };
        return std::array::from_fn(|j| dots[j] + minimums(w, r, x, i0 + j));
    }
    std::array::from_fn(|j| scalar(w, r, x, i0 + j) + minimums(w, r, x, i0 + j))
}

fn scalar(w: &QWeight, r: usize, x: &QRows, i: usize) -> f32 {
    let blocks = w.cols / BLOCK;
    (0..blocks)
        .map(|b| {
            let (wb, xb) = (r * blocks + b, i * blocks + b);
            let xs = &x.quants[i * x.cols + b * BLOCK..][..BLOCK];
            let sum: i32 = match w.format {
                Format::Q8_0 => w.quants[wb * BLOCK..(wb + 1) * BLOCK]
                    .iter()
                    .zip(xs)
                    .map(|(&a, &b)| a as i8 as i32 * b as i32)
                    .sum(),
                Format::Q4_0 | Format::Q4_1 => {
                    let q = &w.quants[wb * BLOCK / 2..(wb + 1) * BLOCK / 2];
                    let offset = if w.format == Format::Q4_0 { 8 } else { 0 };
                    (0..BLOCK / 2)
                        .map(|j| {
                            let lo = (q[j] & 0x0F) as i32 - offset;
                            let hi = (q[j] >> 4) as i32 - offset;
                            lo * xs[j] as i32 + hi * xs[j + BLOCK / 2] as i32
                        })
                        .sum()
                }
            };
            w.scales[wb].to_f32() * x.scales[xb] * sum as f32
        })
        .sum()
}

#[cfg(target_arch = "aarch64")]
mod arm;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Format, QRows, QWeight, BLOCK};
    use std::arch::x86_64::*;

    /// Block `b` of weight row `r` as 32 signed bytes.
    ///
    /// # Safety
    /// AVX2; block b of row r exists.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn weights(w: &QWeight, r: usize, b: usize) -> __m256i {
        let blocks = w.cols / BLOCK;
        match w.format {
            // SAFETY: block b of weight row r is 32 bytes of quants.
            Format::Q8_0 => unsafe {
                _mm256_loadu_si256(w.quants.as_ptr().add((r * blocks + b) * BLOCK) as *const __m256i)
            },
            // SAFETY: 16 bytes of nibbles; low nibbles are weights 0-15, high 16-31.
            Format::Q4_0 | Format::Q4_1 => unsafe {
                let p = w.quants.as_ptr().add((r * blocks + b) * BLOCK / 2);
                let v = _mm_loadu_si128(p as *const __m128i);
                let both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
                let nibbles = _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
                // Q4_1's are 0..=15 as they stand (its minimum is added apart).
                let offset = if w.format == Format::Q4_0 { 8 } else { 0 };
                _mm256_sub_epi8(nibbles, _mm256_set1_epi8(offset))
            },
        }
    }

    /// `acc + d · Σ w·x` over one block, as 8 partial sums: llama.cpp's mul_sum_i8_pairs,
    /// |w| times sign(w)·x as unsigned × signed pairs, summed to 16 then 32 bits.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn block(wv: __m256i, xv: __m256i, d: f32, acc: __m256) -> __m256 {
        let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
        let sums = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(d), acc)
    }

    /// Block `b` of row `i` of x.
    ///
    /// # Safety
    /// AVX2; the block exists.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn activations(x: &QRows, i: usize, b: usize) -> __m256i {
        // SAFETY: the caller's bounds: 32 bytes at row i, block b.
        unsafe {
            _mm256_loadu_si256(x.quants.as_ptr().add(i * x.cols + b * BLOCK) as *const __m256i)
        }
    }

    /// # Safety
    /// AVX2 and FMA; `r` and `i` are rows of `w` and `x`, which have the same width.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(w: &QWeight, r: usize, x: &QRows, i: usize) -> f32 {
        let blocks = w.cols / BLOCK;
        debug_assert_eq!(x.cols, w.cols);
        let mut acc = _mm256_setzero_ps();
        for b in 0..blocks {
            let d = w.scales[r * blocks + b].to_f32() * x.scales[i * blocks + b];
            // SAFETY: block b of row r of w and of row i of x exist.
            let (wv, xv) = unsafe { (weights(w, r, b), activations(x, i, b)) };
            acc = block(wv, xv, d, acc);
        }
        hsum(acc)
    }

    /// # Safety
    /// As [`dot`], for rows `i0..i0 + 4` of x.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot4(w: &QWeight, r: usize, x: &QRows, i0: usize) -> [f32; 4] {
        let blocks = w.cols / BLOCK;
        let mut acc = [_mm256_setzero_ps(); 4];
        for b in 0..blocks {
            let dw = w.scales[r * blocks + b].to_f32();
            // SAFETY: block b of row r of w exists.
            let wv = unsafe { weights(w, r, b) };
            for (j, acc) in acc.iter_mut().enumerate() {
                let i = i0 + j;
                // SAFETY: row i of x exists (the caller's bound).
                let xv = unsafe { activations(x, i, b) };
                *acc = block(wv, xv, dw * x.scales[i * blocks + b], *acc);
            }
        }
        acc.map(|a| hsum(a))
    }

    /// The sum of the 8 lanes.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn hsum(acc: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector forms (where the CPU has them) equal the scalar loop, block by block.
    #[test]
    fn vector_forms_equal_the_scalar_loop() {
        let (rows, cols, m) = (5, 128, 6);
        let wave =
            |n: usize, s: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * s).sin()).collect() };
        let (w, x) = (wave(rows * cols, 0.37), wave(m * cols, 0.91));
        let xq = QRows::quantize(&x, cols);
        for format in [Format::Q8_0, Format::Q4_0, Format::Q4_1] {
            let q = QWeight::quantize(format, &w, cols).unwrap();
            for r in 0..rows {
                let four = dot4(&q, r, &xq, 1);
                for i in 0..m {
                    let want = scalar(&q, r, &xq, i) + minimums(&q, r, &xq, i);
                    let got = dot(&q, r, &xq, i);
                    assert!(
                        (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                        "{format:?}"
                    );
                    if (1..5).contains(&i) {
                        assert!((four[i - 1] - want).abs() <= 1e-4 * want.abs().max(1.0));
                    }
                }
            }
        }
    }
}
