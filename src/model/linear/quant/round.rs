//! Rounding f32 to blocks as ggml's reference quantizers do: weights at load (`--dtype
//! q8_0|q4_0`, and Q4_1 for the tests) and the rows of x, in Q8_0, at every product; and
//! blocks back to f32 (prompt products through `gemm`, and the tests' reference).

use super::kquant::QK_K;
use super::{Format, QRows, QWeight, BLOCK};

impl QRows {
    /// Quantizes each row of `x` (rows of `cols`) to Q8_0 blocks.
    pub fn quantize(x: &[f32], cols: usize) -> Self {
        Self::quantize_span(x, cols, BLOCK)
    }

    /// Quantizes `x` for a product with a weight in `format`: one scale per 256 values
    /// against a K-quant (what its kernels sum in integers, as llama.cpp's Q8_K), else per 32.
    pub fn quantize_for(format: Format, x: &[f32], cols: usize) -> Self {
        Self::quantize_span(x, cols, Self::span_for(format, cols))
    }

    /// The values per scale of [`quantize_for`](Self::quantize_for).
    pub fn span_for(format: Format, cols: usize) -> usize {
        match format.block_weights() {
            QK_K if cols.is_multiple_of(QK_K) => QK_K,
            _ => BLOCK,
        }
    }

    fn quantize_span(x: &[f32], cols: usize, span: usize) -> Self {
        let mut quants = vec![0i8; x.len()];
        // Σ q per half block; |Σ| <= 16 · 127: an i16.
        let mut isums16 = vec![0i16; x.len() / (BLOCK / 2)];
        let mut scales = Vec::with_capacity(x.len() / BLOCK);
        let avx2 = crate::model::linear::simd::Isa::current().has_avx2();
        let spans = (x.chunks_exact(span))
            .zip(quants.chunks_exact_mut(span))
            .zip(isums16.chunks_exact_mut(span / (BLOCK / 2)));
        for ((x, q), sums) in spans {
            let d = match avx2 {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `has_avx2` asked the CPU; span is whole blocks of 32, sums a half
                // block's each.
                true => unsafe { round_x_avx2(x, q, sums) },
                _ => {
                    let d = round_x(x, q);
                    for (s, q) in sums.iter_mut().zip(q.chunks_exact(BLOCK / 2)) {
                        *s = q.iter().map(|&v| v as i16).sum();
                    }
                    d
                }
            };
            scales.extend(std::iter::repeat_n(d, span / BLOCK));
        }
        let sums = (isums16.chunks_exact(2).zip(&scales))
            .map(|(h, d)| d * (h[0] + h[1]) as f32)
            .collect();
        // |Σ| <= 32 · 127: an i16 too. Only the packed Q4_K kernel reads them, and x is
        // rounded per superblock only against a K-quant.
        let isums32 = match span {
            QK_K => isums16.chunks_exact(2).map(|h| h[0] + h[1]).collect(),
            _ => Vec::new(),
        };
        let sums16 = (isums16.iter().enumerate())
            .map(|(h, &s)| scales[h / 2] * s as f32)
            .collect();
        Self {
            cols,
            span,
            scales,
            sums,
            sums16,
            isums16,
            isums32,
            quants,
        }
    }
}

/// x's values in 8 bits with one scale (returned) for all of them, as [`quantize_q8`] but
/// rounding half to even (as llama.cpp's SIMD quantizer of activations does), in a form the
/// compiler vectorizes: a product quantizes its x every time, and `roundf` per value cost
/// as much as a small weight's product at decode.
fn round_x(x: &[f32], q: &mut [i8]) -> f32 {
    // Adding and taking away 1.5 · 2^23 rounds an f32 below 2^22 to an integer, half to even.
    const MAGIC: f32 = 12_582_912.0;
    let mut top = [0f32; 8];
    for c in x.chunks_exact(8) {
        for (t, v) in top.iter_mut().zip(c) {
            *t = if v.abs() > *t { v.abs() } else { *t };
        }
    }
    let rest = x.chunks_exact(8).remainder().iter().map(|v| v.abs());
    let amax = top.into_iter().chain(rest).fold(0f32, f32::max);
    let d = amax / 127.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    for (q, v) in q.iter_mut().zip(x) {
        // Clamped to ±127 as in quantize_q8 (a subnormal d makes inv infinite).
        *q = ((v * inv).clamp(-127.0, 127.0) + MAGIC - MAGIC) as i8;
    }
    d
}

/// [`round_x`] on AVX2, the same values: the largest |x| over all of x, then each block of
/// 32 scaled, clamped to ±127 and rounded half to even (`_mm256_round_ps`, as the adding and
/// taking away of `round_x`), packed to bytes. 5-6x faster than the compiler's form of
/// `round_x`, whose float-to-byte casts it does not vectorize; a batched step rounds every
/// product's rows (8 rows of SmolLM2: 3.6 ms of a 33 ms step before). Each half block's
/// Σ q goes to `sums`, from the bytes in registers: summed apart, in the caller's 128-bit
/// code, they took as long as the rounding (SmolLM2-135M Q4_0, `bench --batch 8`, Zen 5:
/// the roundings 8.9% of a step).
///
/// # Safety
/// AVX2; `x.len()` is a multiple of 32, `q` as long and `sums` a sixteenth.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn round_x_avx2(x: &[f32], q: &mut [i8], sums: &mut [i16]) -> f32 {
    use std::arch::x86_64::*;
    debug_assert!(x.len().is_multiple_of(BLOCK) && q.len() == x.len());
    debug_assert!(sums.len() == x.len() / (BLOCK / 2));
    let sign = _mm256_set1_ps(-0.0);
    let mut top = _mm256_setzero_ps();
    for c in x.chunks_exact(8) {
        // SAFETY: 8 values. abs first, top second: a NaN is passed over, as in `round_x`.
        let v = _mm256_andnot_ps(sign, unsafe { _mm256_loadu_ps(c.as_ptr()) });
        top = _mm256_max_ps(v, top);
    }
    let mut lanes = [0f32; 8];
    // SAFETY: 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), top) };
    let amax = lanes.into_iter().fold(0f32, f32::max);
    let d = amax / 127.0;
    let inv = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
    // packs interleaves 128-bit lanes; this puts the 8 groups of 4 bytes back in order.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let (ones8, ones16) = (_mm256_set1_epi8(1), _mm256_set1_epi16(1));
    let blocks = (x.chunks_exact(BLOCK))
        .zip(q.chunks_exact_mut(BLOCK))
        .zip(sums.chunks_exact_mut(2));
    for ((c, out), sums) in blocks {
        // SAFETY (the four): values 8i..8i + 8 of the block's 32.
        let [r0, r1, r2, r3] = [0, 8, 16, 24].map(|i| c.as_ptr().wrapping_add(i));
        let (a, b) = unsafe {
            (
                _mm256_packs_epi32(rounded8(r0, inv), rounded8(r1, inv)),
                _mm256_packs_epi32(rounded8(r2, inv), rounded8(r3, inv)),
            )
        };
        let bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(a, b), order);
        // SAFETY: 32 bytes.
        unsafe { _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, bytes) };
        // Each 128-bit lane is a half block: its bytes summed by 2, by 4, then across it.
        let fours = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, bytes), ones16);
        let twice = _mm256_hadd_epi32(fours, fours);
        let lanes = _mm256_hadd_epi32(twice, twice);
        sums[0] = _mm256_extract_epi32::<0>(lanes) as i16;
        sums[1] = _mm256_extract_epi32::<4>(lanes) as i16;
    }
    d
}

/// 8 values at `p` times `inv`, clamped to ±127 and rounded half to even, as i32. A
/// function, not a closure: a closure is compiled without its caller's target features.
///
/// # Safety
/// AVX2; 8 values at `p`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn rounded8(p: *const f32, inv: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // SAFETY: the caller's.
    let v = _mm256_mul_ps(unsafe { _mm256_loadu_ps(p) }, inv);
    // A NaN (0 · inf when the scale is subnormal) becomes 0, as `round_x`'s cast makes it.
    let v = _mm256_and_ps(v, _mm256_cmp_ps::<_CMP_ORD_Q>(v, v));
    let v = _mm256_min_ps(
        _mm256_max_ps(v, _mm256_set1_ps(-127.0)),
        _mm256_set1_ps(127.0),
    );
    _mm256_cvtps_epi32(_mm256_round_ps::<
        { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
    >(v))
}

/// Q8_0 of one block into `q` (as bytes); returns the scale.
pub(super) fn quantize_q8(x: &[f32], q: &mut [u8]) -> f32 {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    for (q, v) in q.iter_mut().zip(x) {
        // Clamped to ±127: a subnormal d makes inv infinite, and the kernels' sign trick and
        // `maddubs` bounds rely on |q| <= 127.
        *q = (v * inv).round().clamp(-127.0, 127.0) as i8 as u8;
    }
    d
}

/// Q4_0 of one block into `q` (16 bytes), as ggml's `quantize_row_q4_0_ref`.
pub(super) fn quantize_q4(x: &[f32], q: &mut [u8]) -> f32 {
    let max = x
        .iter()
        .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
    let d = max / -8.0;
    let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
    let level = |v: f32| ((v * inv + 8.5) as i32).min(15) as u8;
    for i in 0..BLOCK / 2 {
        q[i] = level(x[i]) | (level(x[i + BLOCK / 2]) << 4);
    }
    d
}

/// Q4_1 of one block into `q` (16 bytes), as ggml's `quantize_row_q4_1_ref`; returns
/// (d, m).
pub(super) fn quantize_q4_1(x: &[f32], q: &mut [u8]) -> (f32, f32) {
    let min = x.iter().fold(f32::MAX, |m, &v| m.min(v));
    let max = x.iter().fold(f32::MIN, |m, &v| m.max(v));
    let d = (max - min) / 15.0;
    let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
    let level = |v: f32| (((v - min) * inv + 0.5) as i32).min(15) as u8;
    for i in 0..BLOCK / 2 {
        q[i] = level(x[i]) | (level(x[i + BLOCK / 2]) << 4);
    }
    (d, min)
}

impl QWeight {
    /// The weights back in f32 (tests, and a reference).
    pub fn dequantize(&self) -> Vec<f32> {
        (0..self.rows * self.cols / BLOCK)
            .flat_map(|b| self.values(b))
            .collect()
    }

    /// `W[r0 + r, c0 + c]` at `buf[c · rows + r]` for r < rows, c < cols (the layout `gemm`
    /// reads, as `prefill`'s widened bf16); returns the `rows · cols` values written.
    ///
    /// # Panics
    /// If the block is outside W or its columns are not whole blocks.
    pub fn dequantize_transposed<'a>(
        &self,
        (r0, rows): (usize, usize),
        (c0, cols): (usize, usize),
        buf: &'a mut Vec<f32>,
    ) -> &'a [f32] {
        assert!(
            r0 + rows <= self.rows && c0 + cols <= self.cols && (c0 | cols) % BLOCK == 0,
            "dequantize: block ({r0}+{rows}, {c0}+{cols}) is not whole blocks of {}x{}",
            self.rows,
            self.cols
        );
        if buf.len() < rows * cols {
            buf.resize(rows * cols, 0.0);
        }
        let out = &mut buf[..rows * cols];
        if !self.format.split() && !self.packed {
            super::kquant::dequantize_transposed(self, (r0, rows), (c0, cols), out);
            return out;
        }
        let per_row = self.cols / BLOCK;
        let chunks = QK_K / BLOCK;
        for r in 0..rows {
            // A packed K-quant's superblock, rebuilt once for its 8 chunks.
            let mut held: Option<(usize, Vec<u8>)> = None;
            for cb in 0..cols / BLOCK {
                let b = c0 / BLOCK + cb;
                let values = match self.packed && self.format.block_weights() == QK_K {
                    true => {
                        let sb = b / chunks;
                        if held.as_ref().map(|h| h.0) != Some(sb) {
                            held = Some((sb, self.ggml_superblock(r0 + r, sb)));
                        }
                        let blk = held.as_ref().map_or(&[][..], |h| &h.1[..]);
                        super::kquant::values_of(self.format, blk, b % chunks)
                    }
                    false => self.values((r0 + r) * per_row + b),
                };
                for (j, v) in values.into_iter().enumerate() {
                    out[(cb * BLOCK + j) * rows + r] = v;
                }
            }
        }
        out
    }

    /// Block `b`'s 32 weights in f32: `d · q + c`, with c = -8·d for Q4_0, -16·d for Q5_0,
    /// the minimum for Q4_1 and Q5_1 (the one decoding of a block; the kernels keep q as
    /// integers instead); for the formats kept in ggml's blocks, the b-th 32 weights of the
    /// row-major matrix.
    pub(super) fn values(&self, b: usize) -> [f32; BLOCK] {
        if self.packed && self.format.block_weights() == QK_K {
            let (per_row, chunks) = (self.cols / QK_K, QK_K / BLOCK);
            let blk = self.ggml_superblock(b / chunks / per_row, b / chunks % per_row);
            return super::kquant::values_of(self.format, &blk, b % chunks);
        }
        if !self.format.split() && !self.packed {
            return super::kquant::values(self, b);
        }
        let p = self.parts(b);
        let (d, c) = (p.d.to_f32(), p.offset(self.format));
        std::array::from_fn(|j| d * p.quant(self.format, j) as f32 + c)
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// The AVX2 rounding gives `round_x`'s bytes and scale exactly: random rows, rows of
    /// halves (ties to even), zeros and one huge value.
    #[test]
    fn avx2_rounding_equals_the_scalar_form() {
        if !crate::model::linear::simd::Isa::current().has_avx2() {
            eprintln!("SKIPPED: no AVX2 on this CPU");
            return;
        }
        let mut seed = 7u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
        };
        let mut rows: Vec<Vec<f32>> = (0..50)
            .map(|i| (0..32 * (1 + i % 8)).map(|_| next()).collect())
            .collect();
        rows.push((0..64).map(|i| (i as f32 - 31.5) * 127.0 / 32.0).collect());
        // d = 1: every other value is a tie.
        rows.push(
            (0..32)
                .map(|i| if i == 0 { 127.0 } else { i as f32 / 2.0 - 8.0 })
                .collect(),
        );
        rows.push(vec![0.0; 32]);
        // A subnormal scale: 1/d is infinite, and 0 · inf a NaN that both forms round to 0.
        rows.push(
            (0..32)
                .map(|i| if i % 3 == 0 { 1e-37 } else { 0.0 })
                .collect(),
        );
        rows.push(
            (0..32)
                .map(|i| if i == 5 { 3e38 } else { next() })
                .collect(),
        );
        for x in rows {
            let (mut a, mut b) = (vec![0i8; x.len()], vec![0i8; x.len()]);
            let mut sums = vec![0i16; x.len() / 16];
            let da = round_x(&x, &mut a);
            // SAFETY: the CPU has AVX2; x is whole blocks, sums one a half block.
            let db = unsafe { round_x_avx2(&x, &mut b, &mut sums) };
            assert_eq!(da.to_bits(), db.to_bits());
            assert_eq!(a, b, "{x:?}");
            let want: Vec<i16> = (a.chunks_exact(16))
                .map(|h| h.iter().map(|&v| v as i16).sum())
                .collect();
            assert_eq!(sums, want, "half-block sums of {x:?}");
        }
    }
}
