//! The formats read in ggml's blocks, against candle's port of ggml: its quantizers make
//! the bytes (so a misread field shows), its dequantizers say what they mean.

use super::*;
use crate::model::linear::simd::Isa;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

const FORMATS: [(Format, GgmlDType); 7] = [
    (Format::Q5_0, GgmlDType::Q5_0),
    (Format::Q5_1, GgmlDType::Q5_1),
    (Format::Q2K, GgmlDType::Q2K),
    (Format::Q3K, GgmlDType::Q3K),
    (Format::Q4K, GgmlDType::Q4K),
    (Format::Q5K, GgmlDType::Q5K),
    (Format::Q6K, GgmlDType::Q6K),
];

/// Weights with a spread of scales per row and an outlier or two, so that sub-scales and
/// minimums differ from block to block.
fn data(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let h = (i as u32)
                .wrapping_mul(2654435761)
                .wrapping_add(seed.wrapping_mul(97));
            let v = ((h >> 8) % 2001) as f32 / 1000.0 - 1.0;
            let scale = 1.0 + ((i / 16) % 7) as f32 * 0.5;
            if h.is_multiple_of(251) {
                v * 8.0
            } else {
                v * scale + 0.1 * ((i / 32) % 3) as f32
            }
        })
        .collect()
}

/// `format`'s blocks of a rows × cols matrix, made by candle, and its dequantization.
fn made(format: GgmlDType, rows: usize, cols: usize, seed: u32) -> (Vec<u8>, Vec<f32>) {
    let w = Tensor::from_vec(data(rows * cols, seed), (rows, cols), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&w, format).unwrap();
    let back = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap();
    (q.data().unwrap().into_owned(), back.to_vec1().unwrap())
}

#[test]
fn dequantization_equals_ggml() {
    for (format, ggml) in FORMATS {
        let (rows, cols) = (3, 2 * format.block_weights());
        let (bytes, want) = made(ggml, rows, cols, 1);
        let q = QWeight::from_ggml(format, rows, cols, &bytes)
            .unwrap()
            .repacked(false);
        assert_eq!(q.bytes(), bytes.len());
        let got = q.dequantize();
        let top = want.iter().fold(0f32, |a, v| a.max(v.abs()));
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            // The same terms, multiplied in another order (d·s·q − dmin·m).
            assert!(
                (g - w).abs() <= 1e-5 * top,
                "{format:?} weight {k}: {g} vs {w}"
            );
        }
        assert!(QWeight::from_ggml(format, rows, cols, &bytes[1..]).is_none());
        assert!(QWeight::from_ggml(format, rows, cols + 32, &bytes).is_none());
    }
}

/// The product (each ISA the CPU has, and the scalar loop) equals x in Q8_0 times the
/// dequantized weights, on rows that are not a multiple of the pool's split, one to nine
/// rows of x (the single-row and four-row kernels), and several blocks a row.
#[test]
fn products_equal_the_dequantized_weights() {
    for (format, ggml) in FORMATS {
        let (rows, cols) = (13, 3 * format.block_weights());
        let (bytes, dense) = made(ggml, rows, cols, 2);
        let q = QWeight::from_ggml(format, rows, cols, &bytes)
            .unwrap()
            .repacked(false);
        for m in [1, 4, 9] {
            let x = data(m * cols, 3 + m as u32);
            let xq = QRows::quantize_for(format, &x, cols);
            let mut y = vec![0f32; m * rows];
            q.product(&x, &mut y);
            for i in 0..m {
                let xi: Vec<f32> = (0..cols)
                    .map(|c| xq.scales[(i * cols + c) / BLOCK] * xq.quants[i * cols + c] as f32)
                    .collect();
                for r in 0..rows {
                    let want: f32 = (0..cols).map(|c| dense[r * cols + c] * xi[c]).sum();
                    let scalar = scalar(&q, r, &xq, i);
                    let tol = 1e-4
                        * (0..cols)
                            .map(|c| (dense[r * cols + c] * xi[c]).abs())
                            .sum::<f32>();
                    let got = y[i * rows + r];
                    assert!(
                        (got - want).abs() <= tol,
                        "{format:?} m={m} ({i}, {r}): {got} vs {want}"
                    );
                    assert!(
                        (scalar - want).abs() <= tol,
                        "{format:?} scalar ({i}, {r}): {scalar} vs {want}"
                    );
                }
            }
        }
    }
}

/// Each chunk's quants as the SIMD form unpacks them are the scalar ones (through the
/// dot product with x = one-hot rows, where the formats differ only in their unpacking).
#[test]
fn vector_form_equals_the_scalar_loop() {
    if !matches!(
        Isa::current().kind(),
        crate::model::linear::simd::IsaKind::Avx2 | crate::model::linear::simd::IsaKind::Avx512
    ) {
        eprintln!("skipped: this CPU has no AVX2 (the scalar loop is the product here)");
        return;
    }
    for (format, ggml) in FORMATS {
        let (rows, cols) = (5, format.block_weights() * 2);
        let (bytes, _) = made(ggml, rows, cols, 4);
        let q = QWeight::from_ggml(format, rows, cols, &bytes)
            .unwrap()
            .repacked(false);
        let m = 6;
        let xq = QRows::quantize_for(format, &data(m * cols, 5), cols);
        for r in 0..rows {
            // SAFETY: r < rows; rows 0..4 and 0..m of xq, of q's width.
            let (four, one) = unsafe { (dot4(&q, r, &xq, 1), dot(&q, r, &xq, 5)) };
            for (k, got) in four.into_iter().enumerate() {
                let want = scalar(&q, r, &xq, 1 + k);
                assert!(
                    (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                    "{format:?}"
                );
            }
            let want = scalar(&q, r, &xq, 5);
            assert!(
                (one - want).abs() <= 1e-4 * want.abs().max(1.0),
                "{format:?}"
            );
        }
    }
}
