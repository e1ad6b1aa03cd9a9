//! The block formats against their definitions: products, dequantization, ggml's bytes.

use super::*;

fn data(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 2001) as f32 / 1000.0
                - 1.0
        })
        .collect()
}

/// The kernel (AVX2 where the CPU has it) equals the integer dot product written out,
/// for both formats, several rows of x and a ragged pool split.
#[test]
fn product_equals_the_dequantized_integer_dot() {
    let (rows, cols, m) = (37, 96, 7);
    let (w, x) = (data(rows * cols, 1), data(m * cols, 2));
    for format in [Format::Q8_0, Format::Q4_0, Format::Q4_1] {
        let q = QWeight::quantize(format, &w, cols).unwrap();
        let xq = QRows::quantize(&x, cols);
        let mut y = vec![0f32; m * rows];
        q.product(&x, &mut y);
        for i in 0..m {
            for r in 0..rows {
                let want: f32 = (0..cols / BLOCK)
                    .map(|b| {
                        let wb = r * cols / BLOCK + b;
                        let xb = i * cols / BLOCK + b;
                        let dot: i32 = (0..BLOCK)
                            .map(|j| q.quant(wb, j) * xq.quants[xb * BLOCK + j] as i32)
                            .sum();
                        q.scales[wb].to_f32() * xq.scales[xb] * dot as f32 + q.min(wb) * xq.sums[xb]
                    })
                    .sum();
                let got = y[i * rows + r];
                assert!(
                    (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                    "{format:?} {i} {r}: {got} vs {want}"
                );
            }
        }
        // And the dequantized weights are close to the originals.
        let back = q.dequantize();
        let err = w
            .iter()
            .zip(&back)
            .fold(0f32, |a, (u, v)| a.max((u - v).abs()));
        // Half a step, and Q4_0 clamps the top of the range at 7·d: one step.
        let bound = match format {
            Format::Q8_0 => 0.005,
            Format::Q4_0 => 0.13,
            Format::Q4_1 => 0.07,
        };
        assert!(err < bound, "{format:?}: max error {err}");
    }
}

/// ggml's bytes for a matrix read back are the same matrix.
#[test]
fn from_ggml_reads_what_ggml_writes() {
    let (rows, cols) = (3, 64);
    let w = data(rows * cols, 3);
    for format in [Format::Q8_0, Format::Q4_0, Format::Q4_1] {
        let q = QWeight::quantize(format, &w, cols).unwrap();
        let mut bytes = Vec::new();
        for b in 0..q.scales.len() {
            bytes.extend(q.scales[b].to_le_bytes());
            if let Some(m) = q.mins.get(b) {
                bytes.extend(m.to_le_bytes());
            }
            let n = format.quant_bytes();
            bytes.extend(&q.quants[b * n..(b + 1) * n]);
        }
        let back = QWeight::from_ggml(format, rows, cols, &bytes).unwrap();
        assert_eq!(back.dequantize(), q.dequantize(), "{format:?}");
        assert_eq!(back.bytes(), bytes.len());
        assert!(QWeight::from_ggml(format, rows, cols, &bytes[1..]).is_none());
    }
}
