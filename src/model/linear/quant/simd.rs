//! One row of a block-format weight against one Q8_0 row of x: AVX2 (+ FMA) where the CPU
//! has it (`Isa`), NEON on aarch64 (`arm`: `sdot` where the CPU has `dotprod`), a scalar
//! loop elsewhere.
//!
//! The scalar and NEON forms take the weights' stored integers as they are: Q8_0's signed
//! bytes, and the 4-bit formats' nibbles q in 0..=15. What a nibble format adds to each
//! block, `c · d_x · Σ x_q` with c = -8·d (Q4_0's w = d·(q - 8)) or c = m (Q4_1's
//! w = d·q + m), is [`offsets`], from the x block's sum. On AVX2 Q4_0's nibbles become
//! q - 8 in the register and go through `maddubs` with the sign trick, as llama.cpp does:
//! a running scalar sum of offsets, one add per block waiting on the last, made Q4_0
//! decode wait on its latency; Q4_1's minimum keeps it.
//!
//! Over 300 lines on purpose: the one door of a row's dot product for every format (the
//! others are passed on to `kquant`), its ISA forms, and the x86 helpers they share.

#[cfg(target_arch = "x86_64")]
use super::Format;
use super::{QRows, QWeight, BLOCK};
#[cfg(target_arch = "aarch64")]
use crate::model::linear::simd::{Isa, IsaKind};

/// `Σ_b d_w[b] · d_x[b] · Σ_j q_w[b, j] · x[b, j]` over the blocks of weight row `r` and row
/// `i` of x, plus [`offsets`]: the row's dot product.
///
/// # Safety
/// `r` is a row of `w` and `i` a row of `x`, of `w`'s width; `w`'s blocks match its shape
/// (`QWeight::product` checks both once, outside its loops).
pub unsafe fn dot(w: &QWeight, r: usize, x: &QRows, i: usize) -> f32 {
    if w.packed {
        // Only on a CPU without AVX2, where a test packed it (`packed`).
        return packed_reference(w, r, x, i);
    }
    if !w.format.split() {
        // SAFETY: the caller's.
        return unsafe { super::kquant::dot(w, r, x, i) };
    }
    #[cfg(target_arch = "x86_64")]
    {
        use crate::model::linear::simd::{Isa, IsaKind};
        let isa = Isa::current().kind();
        if isa == IsaKind::Avx512 && w.format == Format::Q8_0 && vnni::available() {
            // SAFETY: Isa::current() says this CPU has AVX-512F, BW and VL, and it has VNNI;
            // w is Q8_0; the rest is the caller's.
            return unsafe { vnni::dot_q8_0(w, r, x, i) };
        }
        if matches!(isa, IsaKind::Avx2 | IsaKind::Avx512) {
            // SAFETY: Isa::current() says this CPU has AVX2, FMA and F16C.
            return unsafe { x86::dot(w, r, x, i) };
        }
    }
    #[cfg(target_arch = "aarch64")]
    if Isa::current().kind() == IsaKind::Neon {
        // SAFETY: r and i are rows of w and x (the caller's loop); NEON is checked (`Isa`).
        return unsafe { arm::dot(w, r, x, i) } + offsets(w, r, x, i);
    }
    scalar(w, r, x, i) + offsets(w, r, x, i)
}

/// [`dot`] for rows `i0..i0 + 4` of x: each weight block is loaded (and its nibbles
/// unpacked) once for the four.
///
/// # Safety
/// As [`dot`], for rows `i0..i0 + 4` of `x`.
pub unsafe fn dot4(w: &QWeight, r: usize, x: &QRows, i0: usize) -> [f32; 4] {
    if w.packed {
        return std::array::from_fn(|j| packed_reference(w, r, x, i0 + j));
    }
    if !w.format.split() {
        // SAFETY: the caller's.
        return unsafe { super::kquant::dot4(w, r, x, i0) };
    }
    #[cfg(target_arch = "x86_64")]
    {
        use crate::model::linear::simd::{Isa, IsaKind};
        if matches!(Isa::current().kind(), IsaKind::Avx2 | IsaKind::Avx512) {
            // SAFETY: as in `dot`; rows i0..i0 + 4 of x exist (the caller's loop).
            return unsafe { x86::dot4(w, r, x, i0) };
        }
    }
    #[cfg(target_arch = "aarch64")]
    if Isa::current().kind() == IsaKind::Neon {
        // SAFETY: as in `dot`; rows i0..i0 + 4 of x exist (the caller's loop).
        let dots = unsafe { arm::dot4(w, r, x, i0) };
        return std::array::from_fn(|j| dots[j] + offsets(w, r, x, i0 + j));
    }
    std::array::from_fn(|j| scalar(w, r, x, i0 + j) + offsets(w, r, x, i0 + j))
}

/// `Σ_b c[b] · d_x[b] · Σ_j x[b, j]`: what the offsets of the 4- and 5-bit formats add to a
/// row's dot product (`c` = -8·d for Q4_0, -16·d for Q5_0, the minimum m for Q4_1 and
/// Q5_1; Q8_0 has none).
fn offsets(w: &QWeight, r: usize, x: &QRows, i: usize) -> f32 {
    let blocks = w.cols / BLOCK;
    let sums = &x.sums[i * blocks..(i + 1) * blocks];
    (r * blocks..(r + 1) * blocks)
        .zip(sums)
        .map(|(b, s)| w.parts(b).offset(w.format) * s)
        .sum()
}

/// A packed weight's row against row `i` of x without AVX2: [`scalar`] and [`offsets`] for
/// the 32-weight formats, a K-quant's weights decoded to f32 (one superblock at a time).
fn packed_reference(w: &QWeight, r: usize, x: &QRows, i: usize) -> f32 {
    if w.format.block_weights() == BLOCK {
        return scalar(w, r, x, i) + offsets(w, r, x, i);
    }
    let blocks = w.cols / BLOCK;
    (0..blocks)
        .map(|b| {
            let xb = i * blocks + b;
            let xs = &x.quants[xb * BLOCK..(xb + 1) * BLOCK];
            let dot: f32 = (w.values(r * blocks + b).iter().zip(xs))
                .map(|(w, &q)| w * q as f32)
                .sum();
            dot * x.scales[xb]
        })
        .sum()
}

/// The row's integer dot products, block by block, scaled: the reference the vector forms
/// are tested against, in either layout.
fn scalar(w: &QWeight, r: usize, x: &QRows, i: usize) -> f32 {
    let blocks = w.cols / BLOCK;
    (0..blocks)
        .map(|b| {
            let (wb, xb) = (r * blocks + b, i * blocks + b);
            let xs = &x.quants[xb * BLOCK..(xb + 1) * BLOCK];
            let p = w.parts(wb);
            let sum: i32 = (0..BLOCK)
                .map(|j| p.quant(w.format, j) * xs[j] as i32)
                .sum();
            p.d.to_f32() * x.scales[xb] * sum as f32
        })
        .sum()
}

#[cfg(target_arch = "aarch64")]
mod arm;
#[cfg(target_arch = "x86_64")]
mod vnni;

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::{Format, QRows, QWeight, BLOCK};
    use std::arch::x86_64::*;

    /// The format as a constant, so that each kernel is compiled once per format with no
    /// branch on it in the loop (the branch per block took a seventh of Q4_0 decode).
    const Q8_0: u8 = 0;
    const Q4_0: u8 = 1;
    const Q4_1: u8 = 2;

    /// Block `b` of weight row `r` as 32 bytes: Q8_0's signed bytes, Q4_0's nibbles less 8
    /// (signed, in -8..=7, so no offset remains to add), Q4_1's nibbles 0..=15.
    ///
    /// # Safety
    /// AVX2; block b of row r exists.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn weights<const F: u8>(w: &QWeight, r: usize, b: usize) -> __m256i {
        let blocks = w.cols / BLOCK;
        if F == Q8_0 {
            // SAFETY: block b of weight row r is 32 bytes of quants.
            return unsafe {
                _mm256_loadu_si256(w.quants.as_ptr().add((r * blocks + b) * BLOCK) as *const __m256i)
            };
        }
        // SAFETY: 16 bytes of nibbles; low nibbles are weights 0-15, high 16-31.
        let nibbles = unsafe {
            let p = w.quants.as_ptr().add((r * blocks + b) * BLOCK / 2);
            let v = _mm_loadu_si128(p as *const __m128i);
            let both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
            _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
        };
        match F {
            Q4_0 => _mm256_sub_epi8(nibbles, _mm256_set1_epi8(8)),
            _ => nibbles,
        }
    }

    /// `acc + d · Σ u·s` over one block, as 8 partial sums, for unsigned bytes `u` (at most
    /// 127, or 15 for nibbles, so the pair sums cannot saturate) and signed `s`: `maddubs`
    /// to 16 bits, then pairs to 32.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn block(u: __m256i, s: __m256i, d: f32, acc: __m256) -> __m256 {
        let pairs = _mm256_maddubs_epi16(u, s);
        let sums = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(d), acc)
    }

    /// The two operands of [`block`] for weight bytes `wv` and x bytes `xv`: Q4_1's nibbles
    /// are unsigned already; signed weights go as |w| and sign(w)·x (llama.cpp's
    /// mul_sum_i8_pairs).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn operands<const F: u8>(wv: __m256i, xv: __m256i) -> (__m256i, __m256i) {
        match F {
            Q4_1 => (wv, xv),
            _ => (_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv)),
        }
    }

    /// Block `b` of row `i` of x.
    ///
    /// # Safety
    /// AVX2; the block exists.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn activations(x: &QRows, i: usize, b: usize) -> __m256i {
        // SAFETY: the caller's bounds: 32 bytes at row i, block b.
        unsafe {
            _mm256_loadu_si256(x.quants.as_ptr().add(i * x.cols + b * BLOCK) as *const __m256i)
        }
    }

    /// An f16 as f32 in two instructions (`half`'s conversion is a call per value).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(in crate::model::linear::quant) fn widen(h: half::f16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h.to_bits() as i32)))
    }

    /// # Safety
    /// AVX2, FMA and F16C; `r` and `i` are rows of `w` and `x`, which have the same width.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot(w: &QWeight, r: usize, x: &QRows, i: usize) -> f32 {
        debug_assert!(x.cols == w.cols && !w.packed);
        // SAFETY: the caller's.
        unsafe {
            match w.format {
                Format::Q8_0 => dot_in::<Q8_0>(w, r, x, i),
                Format::Q4_0 => dot_in::<Q4_0>(w, r, x, i),
                Format::Q4_1 => dot_in::<Q4_1>(w, r, x, i),
                _ => unreachable!("{:?} goes to kquant", w.format),
            }
        }
    }

    /// [`dot`] for one format. Two accumulators take even and odd blocks, so consecutive
    /// blocks' FMAs do not wait on each other.
    ///
    /// # Safety
    /// As [`dot`].
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_in<const F: u8>(w: &QWeight, r: usize, x: &QRows, i: usize) -> f32 {
        let blocks = w.cols / BLOCK;
        let mut acc = [_mm256_setzero_ps(); 2];
        let mut mins = 0.0;
        for b in 0..blocks {
            let (wb, xb) = (r * blocks + b, i * blocks + b);
            // SAFETY: block b of row r of w and of row i of x exist.
            let (wv, xv) = unsafe { (weights::<F>(w, r, b), activations(x, i, b)) };
            let (u, s) = operands::<F>(wv, xv);
            acc[b % 2] = block(u, s, widen(w.scales[wb]) * x.scales[xb], acc[b % 2]);
            if F == Q4_1 {
                mins += widen(w.mins[wb]) * x.sums[xb];
            }
        }
        hsum(_mm256_add_ps(acc[0], acc[1])) + mins
    }

    /// # Safety
    /// As [`dot`], for rows `i0..i0 + 4` of x.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot4(w: &QWeight, r: usize, x: &QRows, i0: usize) -> [f32; 4] {
        debug_assert!(!w.packed);
        // SAFETY: the caller's.
        unsafe {
            match w.format {
                Format::Q8_0 => dot4_in::<Q8_0>(w, r, x, i0),
                Format::Q4_0 => dot4_in::<Q4_0>(w, r, x, i0),
                Format::Q4_1 => dot4_in::<Q4_1>(w, r, x, i0),
                _ => unreachable!("{:?} goes to kquant", w.format),
            }
        }
    }

    /// [`dot4`] for one format: each weight block is loaded (and unpacked) once for the four.
    ///
    /// # Safety
    /// As [`dot4`].
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot4_in<const F: u8>(w: &QWeight, r: usize, x: &QRows, i0: usize) -> [f32; 4] {
        let blocks = w.cols / BLOCK;
        let (mut acc, mut mins) = ([_mm256_setzero_ps(); 4], [0f32; 4]);
        for b in 0..blocks {
            let wb = r * blocks + b;
            let (dw, m) = (
                widen(w.scales[wb]),
                match F {
                    Q4_1 => widen(w.mins[wb]),
                    _ => 0.0,
                },
            );
            // SAFETY: block b of row r of w exists.
            let wv = unsafe { weights::<F>(w, r, b) };
            for j in 0..4 {
                let xb = (i0 + j) * blocks + b;
                // SAFETY: row i0 + j of x exists (the caller's bound).
                let xv = unsafe { activations(x, i0 + j, b) };
                let (u, s) = operands::<F>(wv, xv);
                acc[j] = block(u, s, dw * x.scales[xb], acc[j]);
                mins[j] += m * x.sums[xb];
            }
        }
        std::array::from_fn(|j| hsum(acc[j]) + mins[j])
    }

    /// The sum of the 8 lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(in crate::model::linear::quant) fn hsum(acc: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }
}

#[cfg(test)]
mod tests;
