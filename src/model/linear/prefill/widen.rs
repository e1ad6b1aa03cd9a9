//! A block of dense weights (bf16 or f32) as f32 and transposed, for `gemm`: rows × cols of
//! W (row-major, row width k) become `buf[c · rows + r]`. gemm's kernel reads its left
//! operand (our W, after gemm swaps the operands for a row-major y) in this layout as it
//! is; a row-major f32 block it first gathers into it, element by element, which took a
//! third as long as the multiplications themselves at 40 rows of x (f32 `perf` profile).

/// A weight element this copy reads: bf16 (its bits) or f32.
pub trait Elem: Copy {
    /// Whether the element is bf16 bits (widened by a shift) rather than an f32: read by
    /// the AVX2 squares only.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    const BF16: bool;
    fn to_f32(self) -> f32;
}

impl Elem for u16 {
    const BF16: bool = true;
    fn to_f32(self) -> f32 {
        f32::from_bits((self as u32) << 16)
    }
}

impl Elem for f32 {
    const BF16: bool = false;
    fn to_f32(self) -> f32 {
        self
    }
}

/// `W[r0 + r, c0 + c]` as f32 at `buf[c · rows + r]` for r < rows, c < cols; returns the
/// `rows · cols` values written.
///
/// # Panics
/// If the block is not inside `w` (rows of width `k`).
pub fn transposed<'a, T: Elem>(
    w: &[T],
    k: usize,
    (r0, rows): (usize, usize),
    (c0, cols): (usize, usize),
    buf: &'a mut Vec<f32>,
) -> &'a [f32] {
    assert!(
        c0 + cols <= k && (r0 + rows) * k <= w.len(),
        "widen: block ({r0}+{rows}, {c0}+{cols}) is outside w ({} of width {k})",
        w.len()
    );
    if buf.len() < rows * cols {
        buf.resize(rows * cols, 0.0);
    }
    let out = &mut buf[..rows * cols];
    let w = &w[r0 * k + c0..];
    // Whole 8 × 8 squares in registers where the CPU has AVX2, the edges one by one.
    let (r8, c8) = squares(w, k, (rows, cols), out);
    for r in 0..rows {
        let from = if r < r8 { c8 } else { 0 };
        for c in from..cols {
            out[c * rows + r] = w[r * k + c].to_f32();
        }
    }
    out
}

/// Fills `out` for the whole 8 × 8 squares of the block and returns how far they reach
/// (rows, columns): nothing without AVX2.
fn squares<T: Elem>(
    w: &[T],
    k: usize,
    (rows, cols): (usize, usize),
    out: &mut [f32],
) -> (usize, usize) {
    #[cfg(target_arch = "x86_64")]
    if super::super::simd::Isa::current().has_avx2() {
        let (r8, c8) = (rows - rows % 8, cols - cols % 8);
        // SAFETY: this CPU has AVX2; `transposed` checked that rows < r8 and columns < c8
        // of w exist (each read is 8 values of one row, c + 8 <= c8 <= cols <= k - c0), and
        // every write is at (c + j) · rows + r + i < rows · cols = out.len().
        unsafe { squares_avx2(w.as_ptr(), k, (r8, c8), rows, out.as_mut_ptr()) };
        return (r8, c8);
    }
    let _ = (w, k, rows, cols, out); // read only by the AVX2 form
    (0, 0)
}

/// # Safety
/// AVX2; rows < r8 of `w` hold c8 values from the pointer on; `out` holds rows × c8 values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn squares_avx2<T: Elem>(
    w: *const T,
    k: usize,
    (r8, c8): (usize, usize),
    rows: usize,
    out: *mut f32,
) {
    use std::arch::x86_64::*;
    for r in (0..r8).step_by(8) {
        for c in (0..c8).step_by(8) {
            let mut v = [_mm256_setzero_ps(); 8];
            for (i, v) in v.iter_mut().enumerate() {
                // SAFETY: the caller's bounds.
                *v = unsafe { load8(w.add((r + i) * k + c)) };
            }
            // The classic 8 × 8 transpose: pairs of rows interleaved, then quads, then
            // 128-bit halves. q[i] holds columns i and i + 4 of rows 0-3, q[i + 4] of 4-7.
            let t = [
                _mm256_unpacklo_ps(v[0], v[1]),
                _mm256_unpackhi_ps(v[0], v[1]),
                _mm256_unpacklo_ps(v[2], v[3]),
                _mm256_unpackhi_ps(v[2], v[3]),
                _mm256_unpacklo_ps(v[4], v[5]),
                _mm256_unpackhi_ps(v[4], v[5]),
                _mm256_unpacklo_ps(v[6], v[7]),
                _mm256_unpackhi_ps(v[6], v[7]),
            ];
            let q = [
                _mm256_shuffle_ps::<0x44>(t[0], t[2]),
                _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
                _mm256_shuffle_ps::<0x44>(t[1], t[3]),
                _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
                _mm256_shuffle_ps::<0x44>(t[4], t[6]),
                _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
                _mm256_shuffle_ps::<0x44>(t[5], t[7]),
                _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
            ];
            for j in 0..8 {
                let (a, b) = (q[j % 4], q[j % 4 + 4]);
                let column = match j < 4 {
                    true => _mm256_permute2f128_ps::<0x20>(a, b),
                    false => _mm256_permute2f128_ps::<0x31>(a, b),
                };
                // SAFETY: the caller's bounds.
                unsafe { _mm256_storeu_ps(out.add((c + j) * rows + r), column) };
            }
        }
    }
}

/// Eight values as f32 (bf16 widened).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn load8<T: Elem>(p: *const T) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    if !T::BF16 {
        // SAFETY: the caller guarantees 8 readable values at p, f32 here.
        return unsafe { _mm256_loadu_ps(p as *const f32) };
    }
    // SAFETY: as above, bf16 bits here.
    let v = unsafe { _mm_loadu_si128(p as *const __m128i) };
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(v)))
}

#[cfg(test)]
mod tests {
    /// Every value lands in its place, exactly, for a block with ragged edges (17 × 21 at an
    /// offset, so both the 8 × 8 squares and the edges are taken).
    #[test]
    fn transposed_block_is_exact() {
        let (n, k) = (30, 40);
        let w: Vec<u16> = (0..n * k)
            .map(|i| (i * 7919 % 65521) as u16 & 0x7f7f)
            .collect();
        let (r0, rows, c0, cols) = (5, 17, 3, 21);
        let mut buf = Vec::new();
        let got = super::transposed(&w, k, (r0, rows), (c0, cols), &mut buf).to_vec();
        let wide: Vec<f32> = w
            .iter()
            .map(|&b| f32::from_bits((b as u32) << 16))
            .collect();
        let copied = super::transposed(&wide, k, (r0, rows), (c0, cols), &mut buf);
        for r in 0..rows {
            for c in 0..cols {
                let want = wide[(r0 + r) * k + c0 + c];
                assert_eq!(got[c * rows + r].to_bits(), want.to_bits(), "r {r} c {c}");
                assert_eq!(
                    copied[c * rows + r].to_bits(),
                    want.to_bits(),
                    "f32: r {r} c {c}"
                );
            }
        }
    }
}
