//! The packed layout holds the same weights as the rows, and its kernel (where the CPU has
//! AVX2: each set of tiles it runs) and the scalar loop over it equal x times the
//! dequantized weights: every packed format, weight rows that are not a multiple of 8 (a
//! pair of groups, a pair and one), 1 to 37 rows of x (the tile's 4, or Q6_K's, Q3_K's and
//! Q2_K's 8 with AVX-512 VNNI, then 4, and the single rows after them; AMX's 16 before them).

use super::super::{Format, QRows, QWeight, BLOCK};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use half::f16;

const FORMATS: [(Format, GgmlDType); 10] = [
    (Format::Q8_0, GgmlDType::Q8_0),
    (Format::Q4_0, GgmlDType::Q4_0),
    (Format::Q4_1, GgmlDType::Q4_1),
    (Format::Q5_0, GgmlDType::Q5_0),
    (Format::Q5_1, GgmlDType::Q5_1),
    (Format::Q4K, GgmlDType::Q4K),
    (Format::Q5K, GgmlDType::Q5K),
    (Format::Q6K, GgmlDType::Q6K),
    (Format::Q3K, GgmlDType::Q3K),
    (Format::Q2K, GgmlDType::Q2K),
];

/// A `rows x cols` weight in `format`, from the bytes candle's port of ggml's quantizers
/// writes, as it was read (rows; Q5 in ggml's blocks).
fn weight((format, ggml): (Format, GgmlDType), rows: usize, cols: usize, seed: u32) -> QWeight {
    let w = Tensor::from_vec(data(rows * cols, seed), (rows, cols), &Device::Cpu).unwrap();
    let bytes = QTensor::quantize(&w, ggml)
        .unwrap()
        .data()
        .unwrap()
        .into_owned();
    QWeight::from_ggml(format, rows, cols, &bytes)
        .unwrap()
        .repacked(false)
}

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

/// `x · qᵀ` by `product`, and on x86 by each set of the packed kernel's tiles this CPU runs
/// (AVX2's; AVX-512 VNNI's 8-row and 16-row ones; AVX-VNNI's), whatever `product` chose.
fn products(q: &QWeight, x: &[f32]) -> Vec<(&'static str, Vec<f32>)> {
    let m = x.len() / q.cols;
    let mut y = vec![f32::NAN; m * q.rows];
    q.product(x, &mut y);
    #[allow(unused_mut)]
    let mut out = vec![("product", y)];
    #[cfg(target_arch = "x86_64")]
    {
        use super::x86::{EVEX, MADD, VEX};
        use crate::model::linear::simd::{Isa, IsaKind};
        let vnni = Isa::detect().kind() == IsaKind::Avx512 && super::super::tile::vnni::available();
        let avx_vnni = Isa::detect().has_avx2() && std::arch::is_x86_feature_detected!("avxvnni");
        let amx = vnni && crate::model::linear::simd::amx();
        let sets = [
            ("avx2 tiles", MADD, false, false, Isa::detect().has_avx2()),
            ("vnni tiles", EVEX, false, false, vnni),
            ("vnni pairs", EVEX, true, false, vnni),
            ("amx tiles", EVEX, true, true, amx),
            ("avx-vnni tiles", VEX, false, false, avx_vnni),
        ];
        for (name, dot, pairs, amx, runs) in sets {
            if !runs {
                continue;
            }
            let xq = QRows::quantize_for(q.format, x, q.cols);
            let mut y = vec![f32::NAN; m * q.rows];
            let groups = (0, q.rows.div_ceil(super::ROWS));
            let tiles = super::x86::tiles(q.format, dot, pairs, amx);
            // SAFETY: the CPU has AVX2 (and the VNNI of `dot` where asked); q is packed and
            // its planes fit (the constructors and `repacked`); xq holds m rows of its width;
            // y is m × rows.
            unsafe { super::x86::rows_with(&tiles, q, groups, &xq, y.as_mut_ptr()) };
            out.push((name, y));
        }
    }
    out
}

#[test]
fn packing_keeps_every_weight() {
    let rows = 13;
    for f in FORMATS {
        let cols = 2 * f.0.block_weights().max(3 * BLOCK);
        let (format, rowwise) = (f.0, weight(f, rows, cols, 1));
        let packed = rowwise.clone().repacked(true);
        assert!(packed.is_packed() && !rowwise.is_packed());
        assert_eq!(packed.dequantize(), rowwise.dequantize(), "{format:?}");
        let (mut a, mut b) = (Vec::new(), Vec::new());
        assert_eq!(
            packed.dequantize_transposed((5, 8), (BLOCK, 2 * BLOCK), &mut a),
            rowwise.dequantize_transposed((5, 8), (BLOCK, 2 * BLOCK), &mut b),
        );
        // Padded to 16 rows: 3 rows of zeros more, nothing else (Q3_K, Q4_K and Q5_K: their
        // scales unpacked, 114, 148 and 180 bytes a superblock instead of ggml's 110, 144 and
        // 176).
        let per_row = match format {
            Format::Q4K => cols / 256 * 148,
            Format::Q5K => cols / 256 * 180,
            Format::Q6K => cols / 256 * 210,
            Format::Q3K => cols / 256 * 114,
            Format::Q2K => cols / 256 * 84,
            _ => rowwise.bytes() / rows,
        };
        assert_eq!(packed.bytes(), 16 * per_row, "{format:?}");
        let back = packed.repacked(false);
        assert_eq!(
            (&back.scales, &back.mins, &back.quants, &back.highs),
            (
                &rowwise.scales,
                &rowwise.mins,
                &rowwise.quants,
                &rowwise.highs
            ),
            "{format:?}"
        );
    }
}

/// `from_ggml` packs a file's weight a group of 8 rows at a time (where the CPU packs): the
/// same planes as the whole weight read in rows and packed at once, for rows that fill their
/// last group or not, one group or several.
#[test]
fn a_file_weight_packed_by_groups_equals_it_packed_whole() {
    for f in FORMATS {
        let cols = f.0.block_weights().max(3 * BLOCK);
        for rows in [1, 8, 9, 16, 21] {
            let w = Tensor::from_vec(data(rows * cols, 5), (rows, cols), &Device::Cpu).unwrap();
            let bytes = QTensor::quantize(&w, f.1)
                .unwrap()
                .data()
                .unwrap()
                .into_owned();
            let read = QWeight::from_ggml(f.0, rows, cols, &bytes)
                .unwrap()
                .repacked(true);
            let whole = QWeight::ggml_rows(f.0, rows, cols, &bytes).repacked(true);
            assert_eq!(
                (
                    read.rows,
                    &read.scales,
                    &read.mins,
                    &read.quants,
                    &read.highs
                ),
                (
                    whole.rows,
                    &whole.scales,
                    &whole.mins,
                    &whole.quants,
                    &whole.highs
                ),
                "{:?}, {rows} rows",
                f.0
            );
            assert!(read.packed_fits(), "{:?}, {rows} rows", f.0);
        }
    }
}

#[test]
fn packed_products_equal_the_dequantized_product() {
    // 2 groups of 8 rows (a pair, the last padded) and 3 (a pair and one).
    for (rows, f) in [13, 21].into_iter().flat_map(|r| FORMATS.map(|f| (r, f))) {
        let format = f.0;
        let widths: &[usize] = match format {
            Format::Q2K | Format::Q3K | Format::Q4K | Format::Q5K | Format::Q6K => &[8, 16],
            _ => &[1, 3, 6],
        };
        for &blocks in widths {
            let cols = blocks * BLOCK;
            let q = weight(f, rows, cols, 2).repacked(true);
            let dense = q.dequantize();
            for m in [1, 2, 4, 5, 9, 13, 16, 17, 37] {
                let x = data(m * cols, 3 + m as u32);
                let xq = QRows::quantize_for(format, &x, cols);
                let kernels = products(&q, &x);
                for i in 0..m {
                    for r in 0..rows {
                        let terms = (0..cols).map(|c| {
                            let xv =
                                xq.scales[(i * cols + c) / BLOCK] * xq.quants[i * cols + c] as f32;
                            dense[r * cols + c] * xv
                        });
                        let (want, size) =
                            terms.fold((0f32, 0f32), |(s, a), t| (s + t, a + t.abs()));
                        // SAFETY: r and i are rows of q and xq, made for its width.
                        let scalar = unsafe { super::super::simd::dot(&q, r, &xq, i) };
                        let got = kernels.iter().map(|(name, y)| (*name, y[i * rows + r]));
                        for (name, got) in got.chain([("scalar", scalar)]) {
                            assert!(
                                (got - want).abs() <= 1e-4 * size,
                                "{name} {format:?} {blocks} blocks, m={m} ({i}, {r}): \
                                 {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The sums' 16-bit bounds at their worst: every quant at its largest (Q8_0's −128 from a
/// file), x at ±127 everywhere, whole groups of rows (16) and several x rows (AMX's 16, the
/// tile's 4, or Q6_K's, Q3_K's and Q2_K's 8, and the single row after them).
#[test]
fn extreme_blocks_stay_within_the_sums_bounds() {
    let (rows, cols) = (16, 256);
    let one = f16::ONE.to_le_bytes();
    for (format, block) in [
        (Format::Q8_0, [&one[..], &[0x80; 32]].concat()),
        (Format::Q4_0, [&one[..], &[0xFF; 16]].concat()),
        (Format::Q4_1, [&one[..], &one[..], &[0xFF; 16]].concat()),
        (Format::Q5_0, [&one[..], &[0xFF; 4], &[0xFF; 16]].concat()),
        (
            Format::Q5_1,
            [&one[..], &one[..], &[0xFF; 4], &[0xFF; 16]].concat(),
        ),
        (
            Format::Q4K,
            [&one[..], &one[..], &[0xFF; 12], &[0xFF; 128]].concat(),
        ),
        // Q4_K with scales and minimums of every size, sub-blocks 4-7's above 16 (their
        // top bits in the first 8 bytes).
        (
            Format::Q4K,
            [
                &one[..],
                &one[..],
                &[
                    0xC1, 0x7F, 0x02, 0xFF, 0x43, 0x80, 0x3F, 0xC5, 0xF1, 0x2E, 0x9B, 0x0C,
                ],
                &[0xFF; 128],
            ]
            .concat(),
        ),
        // Q5_K: every q at 31, every scale and minimum at 63.
        (
            Format::Q5K,
            [&one[..], &one[..], &[0xFF; 12], &[0xFF; 32], &[0xFF; 128]].concat(),
        ),
        // Q6_K: every q at 63 and every scale at -128 (ggml's d comes last).
        (
            Format::Q6K,
            [&[0xFF; 192][..], &[0x80; 16], &one[..]].concat(),
        ),
        // Q3_K: every q at 7 (every high bit set) and every scale at 63 − 32, then at
        // 0 − 32 (ggml's hmask, qs, 12 bytes of scales, d).
        (
            Format::Q3K,
            [&[0xFF; 96][..], &[0xFF; 12], &one[..]].concat(),
        ),
        (
            Format::Q3K,
            [&[0xFF; 96][..], &[0x00; 12], &one[..]].concat(),
        ),
        // Q2_K: every q at 3, every scale and minimum at 15 (scales, qs, d, dmin); then
        // scales at 15 and minimums at 1, which a swap of the two would not keep.
        (
            Format::Q2K,
            [&[0xFF; 16][..], &[0xFF; 64], &one[..], &one[..]].concat(),
        ),
        (
            Format::Q2K,
            [&[0x1F; 16][..], &[0xFF; 64], &one[..], &one[..]].concat(),
        ),
    ] {
        let per_row = cols / format.block_weights();
        let bytes = block.repeat(rows * per_row);
        let q = QWeight::from_ggml(format, rows, cols, &bytes)
            .unwrap()
            .repacked(true);
        let dense = q.dequantize();
        for sign in [1.0f32, -1.0] {
            let m = 17;
            let x = vec![sign; m * cols];
            for (name, y) in products(&q, &x) {
                for (i, got) in y.iter().enumerate() {
                    let want: f32 = dense[(i % rows) * cols..][..cols]
                        .iter()
                        .map(|w| w * sign)
                        .sum();
                    assert!(
                        (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                        "{name} {format:?} x = {sign}: {got} vs {want}"
                    );
                }
            }
        }
    }
}

/// Several weights of one width through `QWeight::products` against each `product` alone:
/// groups of 8 rows that are odd in number (a chunk then starts a weight mid-pair), a weight
/// smaller than a chunk, formats that round x alike (one product) and a K-quant beside a
/// 32-weight format (rounded apart: each alone), 1 to 130 rows of x.
#[test]
fn products_of_several_weights_equal_each_alone() {
    let cols = 512;
    let sets: [&[(usize, usize)]; 3] = [
        &[(1, 24), (3, 13), (0, 8), (5, 40)], // Q4_0 x2 (24 rows: 3 groups), Q8_0, Q5_1
        &[(5, 21), (7, 5)],                   // Q4_K and Q6_K: both per superblock
        &[(1, 16), (5, 9), (2, 3)],           // Q4_0, Q4_K, Q4_1: two roundings of x
    ];
    for set in sets {
        let ws: Vec<QWeight> = (set.iter().enumerate())
            .map(|(i, &(f, rows))| weight(FORMATS[f], rows, cols, 10 + i as u32).repacked(true))
            .collect();
        let refs: Vec<&QWeight> = ws.iter().collect();
        // 130 rows: two blocks of x (128 rows of 512 values, then 2).
        for m in [1, 3, 8, 13, 130] {
            let x = data(m * cols, 40 + m as u32);
            let mut ys: Vec<Vec<f32>> = ws.iter().map(|w| vec![f32::NAN; m * w.rows]).collect();
            let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(|y| &mut y[..]).collect();
            QWeight::products(&refs, &x, &mut outs);
            for (w, got) in ws.iter().zip(&ys) {
                let mut want = vec![f32::NAN; m * w.rows];
                w.product(&x, &mut want);
                for (i, (g, v)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - v).abs() <= 1e-5 * v.abs().max(1.0),
                        "{:?} {}x{cols}, m={m}, value {i}: {g} together, {v} alone",
                        w.format,
                        w.rows
                    );
                }
            }
        }
    }
}
