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
                        q.parts(wb).d.to_f32() * xq.scales[xb] * dot as f32
                            + q.parts(wb).m.to_f32() * xq.sums[xb]
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
            _ => 0.07,
        };
        assert!(err < bound, "{format:?}: max error {err}");
    }
}

/// ggml's bytes for a matrix read back are the same matrix.
#[test]
fn from_ggml_reads_what_ggml_writes() {
    // The bytes come from candle's port of ggml's quantizers (`QTensor::quantize`), not
    // from our layout, so a misread field would show.
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};
    let (rows, cols) = (3, 64);
    let w = data(rows * cols, 3);
    let t = Tensor::from_vec(w.clone(), (rows, cols), &Device::Cpu).unwrap();
    for (format, ggml) in [
        (Format::Q8_0, GgmlDType::Q8_0),
        (Format::Q4_0, GgmlDType::Q4_0),
        (Format::Q4_1, GgmlDType::Q4_1),
    ] {
        let theirs = QTensor::quantize(&t, ggml).unwrap();
        let bytes = theirs.data().unwrap();
        let back = QWeight::from_ggml(format, rows, cols, &bytes).unwrap();
        let want = theirs
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap();
        assert_eq!(
            back.dequantize(),
            want.to_vec1::<f32>().unwrap(),
            "{format:?}"
        );
        // Rows as the file has them (packed, 3 rows are padded to 8).
        assert_eq!(back.repacked(false).bytes(), bytes.len());
        assert!(QWeight::from_ggml(format, rows, cols, &bytes[1..]).is_none());
    }
}

/// Sizes from a file may be anything: a shape whose product overflows is refused, not
/// wrapped into a small weight that the kernels would read past.
#[test]
fn from_ggml_refuses_sizes_that_overflow() {
    let bytes = vec![0u8; 4 * 34];
    assert!(QWeight::from_ggml(Format::Q8_0, (1 << 61) + 4, 32, &bytes).is_none());
    assert!(QWeight::from_ggml(Format::Q8_0, usize::MAX, 32, &bytes).is_none());
    assert!(QWeight::from_ggml(Format::Q8_0, 4, 0, &bytes).is_none());
    let q = QWeight::from_ggml(Format::Q8_0, 4, 32, &bytes).unwrap();
    let mut y = vec![0f32; 4];
    q.product(&[1.0; 32], &mut y);
    assert_eq!(y, [0.0; 4]);
}

/// More rows of x than the tile takes at once (`x_block_rows`): every block of rows, the
/// last one ragged, equals the same rows multiplied one at a time, in every format (the
/// K-quants from candle's port of ggml's quantizers).
#[test]
fn many_rows_in_blocks_equal_rows_one_at_a_time() {
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};
    let (rows, cols) = (9, 512);
    let m = 2 * tile::x_block_rows(cols) + 3;
    let w = data(rows * cols, 4);
    let t = Tensor::from_vec(w, (rows, cols), &Device::Cpu).unwrap();
    let x = data(m * cols, 5);
    for (format, ggml) in [
        (Format::Q8_0, GgmlDType::Q8_0),
        (Format::Q4_0, GgmlDType::Q4_0),
        (Format::Q5_1, GgmlDType::Q5_1),
        (Format::Q4K, GgmlDType::Q4K),
        (Format::Q6K, GgmlDType::Q6K),
    ] {
        let bytes = QTensor::quantize(&t, ggml)
            .unwrap()
            .data()
            .unwrap()
            .into_owned();
        let q = QWeight::from_ggml(format, rows, cols, &bytes).unwrap();
        let mut all = vec![f32::NAN; m * rows];
        q.product(&x, &mut all);
        for (i, (x, got)) in x.chunks(cols).zip(all.chunks(rows)).enumerate() {
            let mut want = vec![0f32; rows];
            q.product(x, &mut want);
            for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-4 * w.abs().max(1.0),
                    "{format:?} row {i} of {m}, column {r}: {g} vs {w}"
                );
            }
        }
    }
}
