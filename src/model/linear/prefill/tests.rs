//! The prompt products' routes and results (`prefill.rs`).

use super::*;
use crate::model::linear::quant::Format;

fn data(n: usize, seed: u32) -> Vec<f32> {
    let v = |i: u32| ((i.wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 2001) as f32;
    (0..n as u32).map(|i| v(i) / 1000.0 - 1.0).collect()
}

/// f32 products on either side of the crossover to `gemm` (AVX2's at 17 rows, full-width
/// AVX-512's at 128, where AVX2's copies of W stop) go where this CPU's set says, and equal
/// plain sums either way: each host covers its own crossover. W is more than one block each
/// way (rows and columns, ragged), so the copies' edges and their sums over column blocks
/// are taken.
#[test]
fn f32_rows_either_side_of_gemm_equal_plain_sums() {
    let (n, k) = (BLOCK_ROWS + 5, BLOCK_K + 88);
    assert_eq!(
        F32_IN_PLACE_ROWS, F32_GEMM_ROWS_AVX512,
        "the rows below are either side of both"
    );
    let w = data(n * k, 7);
    for m in [
        F32_GEMM_ROWS - 1,
        F32_GEMM_ROWS_AVX512 - 1,
        F32_GEMM_ROWS_AVX512 + 3,
    ] {
        let want_gemm = match Isa::current().kind() {
            IsaKind::Avx2 => m >= F32_GEMM_ROWS,
            IsaKind::Avx512 => m >= F32_GEMM_ROWS_AVX512 && simd::full_width_512(),
            IsaKind::Neon | IsaKind::Scalar => false,
        };
        assert_eq!(by_gemm(m, Weights::F32(&w)), want_gemm, "{m} rows");
        let x = data(m * k, 8);
        let mut y = vec![0f32; m * n];
        crate::model::linear::matvec::rows_f32(&x, k, &w, &mut y);
        for (i, row) in y.chunks_exact(n).enumerate() {
            for (j, got) in row.iter().enumerate() {
                let dot = |c: usize| x[i * k + c] as f64 * w[j * k + c] as f64;
                let want: f64 = (0..k).map(dot).sum();
                let err = (*got as f64 - want).abs();
                assert!(err < 1e-4 * (1.0 + want.abs()), "{m} rows: {got} vs {want}");
            }
        }
    }
}

/// Prompt-sized products (on AVX2) dequantize blocks of W for `gemm`: they equal the f32
/// product with the dequantized weights (x is not quantized there).
#[test]
fn many_rows_equal_the_dequantized_f32_product() {
    let (rows, cols, m) = (200, 576, 20);
    let (w, x) = (data(rows * cols, 5), data(m * cols, 6));
    for format in [Format::Q8_0, Format::Q4_0, Format::Q4_1] {
        let q = QWeight::quantize(format, &w, cols).unwrap();
        let dense = q.dequantize();
        let mut y = vec![0f32; m * rows];
        super::super::blocks_product(&q, &x, &mut y);
        for i in 0..m {
            for r in 0..rows {
                let want: f32 = (0..cols)
                    .map(|c| x[i * cols + c] * dense[r * cols + c])
                    .sum();
                let got = y[i * rows + r];
                // Without AVX2 the integer kernels run, x quantized to 8 bits.
                let tol = match by_gemm(m, Weights::Blocks(&q)) {
                    true => 1e-3 * want.abs().max(1.0),
                    false => 0.2,
                };
                assert!(
                    (got - want).abs() <= tol,
                    "{format:?} {i} {r}: {got} vs {want}"
                );
            }
        }
        let mut buf = Vec::new();
        let t = q.dequantize_transposed((3, 5), (64, 32), &mut buf);
        assert_eq!(t[2 * 5 + 1], dense[4 * cols + 66]);
    }
}
