//! Every tile kernel this CPU runs (AVX2's, AVX-512's, AVX-512 VNNI's), called directly,
//! against x times the dequantized weights: every format, weight rows that are not a
//! multiple of the tile, 2 to 9 rows of x, and rows of an odd and an even number of chunks
//! per group (the VNNI kernel pairs chunks, and leaves odd groups to AVX-512's).

use super::super::{Format, QRows, QWeight, BLOCK};
use super::x86;
use super::*;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

const FORMATS: [(Format, GgmlDType); 10] = [
    (Format::Q8_0, GgmlDType::Q8_0),
    (Format::Q4_0, GgmlDType::Q4_0),
    (Format::Q4_1, GgmlDType::Q4_1),
    (Format::Q5_0, GgmlDType::Q5_0),
    (Format::Q5_1, GgmlDType::Q5_1),
    (Format::Q2K, GgmlDType::Q2K),
    (Format::Q3K, GgmlDType::Q3K),
    (Format::Q4K, GgmlDType::Q4K),
    (Format::Q5K, GgmlDType::Q5K),
    (Format::Q6K, GgmlDType::Q6K),
];

fn data(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let h = (i as u32)
                .wrapping_mul(2654435761)
                .wrapping_add(seed.wrapping_mul(97));
            (((h >> 8) % 2001) as f32 / 1000.0 - 1.0) * (1.0 + ((i / 16) % 5) as f32 * 0.5)
        })
        .collect()
}

type Kernel = unsafe fn(&QWeight, (usize, usize), &QRows, *mut f32);

#[test]
fn every_tile_kernel_equals_the_dequantized_product() {
    let isa = Isa::current().kind();
    let mut kernels: Vec<(&str, Kernel)> = Vec::new();
    if matches!(isa, IsaKind::Avx2 | IsaKind::Avx512) {
        kernels.push(("avx2 3x4", x86::rows::<3, 4>));
        kernels.push(("avx2 4x3", x86::rows::<4, 3>));
    }
    if isa == IsaKind::Avx512 {
        kernels.push(("avx512", x86::rows_512::<4, 4>));
        if vnni::available() {
            kernels.push(("vnni", vnni::rows::<4, 4>));
        }
    }
    eprintln!(
        "tile kernels on this CPU: {:?}",
        kernels.iter().map(|k| k.0).collect::<Vec<_>>()
    );
    let rows = 7;
    for (format, ggml) in FORMATS {
        // Blocks per row: an odd group (3 or 9 blocks), even ones (6; 16 = two groups of 8),
        // and for a K-quant two superblocks.
        let widths: &[usize] = match format.block_weights() {
            BLOCK => &[3, 6, 9, 16],
            _ => &[16],
        };
        for &blocks in widths {
            let cols = blocks * BLOCK;
            let w = Tensor::from_vec(data(rows * cols, 1), (rows, cols), &Device::Cpu).unwrap();
            let bytes = QTensor::quantize(&w, ggml)
                .unwrap()
                .data()
                .unwrap()
                .into_owned();
            let q = QWeight::from_ggml(format, rows, cols, &bytes)
                .unwrap()
                .repacked(false);
            let dense = q.dequantize();
            for m in [2, 5, 9] {
                let xq = QRows::quantize_for(format, &data(m * cols, 2 + m as u32), cols);
                for (name, kernel) in &kernels {
                    let mut y = vec![f32::NAN; m * rows];
                    // SAFETY: the kernel is this CPU's; rows 0..7 of q; m rows of xq, made
                    // for q's format and width; y holds m × rows.
                    unsafe { kernel(&q, (0, rows), &xq, y.as_mut_ptr()) };
                    for i in 0..m {
                        for r in 0..rows {
                            let terms = (0..cols).map(|c| {
                                let xv = xq.scales[(i * cols + c) / BLOCK]
                                    * xq.quants[i * cols + c] as f32;
                                dense[r * cols + c] * xv
                            });
                            let (want, size) =
                                terms.fold((0f32, 0f32), |(s, a), t| (s + t, a + t.abs()));
                            let got = y[i * rows + r];
                            assert!(
                                (got - want).abs() <= 1e-4 * size,
                                "{name} {format:?} {blocks} blocks, m={m} ({i}, {r}): {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}
