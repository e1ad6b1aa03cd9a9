//! Rounding f32 to blocks as ggml's reference quantizers do: weights at load (`--dtype
//! q8_0|q4_0`, and Q4_1 for the tests) and the rows of x, in Q8_0, at every product.

use super::{QRows, BLOCK};

impl QRows {
    /// Quantizes each row of `x` (rows of `cols`) to Q8_0 blocks.
    pub fn quantize(x: &[f32], cols: usize) -> Self {
        let mut quants = vec![0u8; x.len()];
        let scales: Vec<f32> = x
            .chunks_exact(BLOCK)
            .zip(quants.chunks_exact_mut(BLOCK))
            .map(|(x, q)| quantize_q8(x, q))
            .collect();
        // Two's complement bytes read as i8.
        let quants: Vec<i8> = quants.into_iter().map(|b| b as i8).collect();
        let sums = (quants.chunks_exact(BLOCK).zip(&scales))
            .map(|(q, d)| d * q.iter().map(|&v| v as i32).sum::<i32>() as f32)
            .collect();
        Self {
            cols,
            scales,
            sums,
            quants,
        }
    }
}

/// Q8_0 of one block into `q` (as bytes); returns the scale.
pub(super) fn quantize_q8(x: &[f32], q: &mut [u8]) -> f32 {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    for (q, v) in q.iter_mut().zip(x) {
        *q = (v * inv).round() as i8 as u8;
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
