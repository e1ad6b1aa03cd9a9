//! Each ISA's block dot products against the scalar loop, on every format.

use super::super::Format;
use super::*;

/// The vector forms (where the CPU has them) equal the scalar loop, block by block.
#[test]
fn vector_forms_equal_the_scalar_loop() {
    // 4 blocks a row, and 5: the AVX-512 VNNI Q8_0 kernel takes blocks in pairs.
    for (format, cols) in [Format::Q8_0, Format::Q4_0, Format::Q4_1]
        .into_iter()
        .flat_map(|f| [(f, 128), (f, 160)])
    {
        let (rows, m) = (5, 6);
        let wave =
            |n: usize, s: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * s).sin()).collect() };
        let (w, x) = (wave(rows * cols, 0.37), wave(m * cols, 0.91));
        let xq = QRows::quantize(&x, cols);
        let q = QWeight::quantize(format, &w, cols).unwrap().repacked(false);
        for r in 0..rows {
            // SAFETY: r < rows and 1 + 4 <= m rows of xq, made for this weight.
            let four = unsafe { dot4(&q, r, &xq, 1) };
            for i in 0..m {
                let want = scalar(&q, r, &xq, i) + offsets(&q, r, &xq, i);
                // SAFETY: as above, row i < m.
                let got = unsafe { dot(&q, r, &xq, i) };
                assert!(
                    (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                    "{format:?}"
                );
                if (1..5).contains(&i) {
                    assert!((four[i - 1] - want).abs() <= 1e-4 * want.abs().max(1.0));
                }
                // AVX2's row kernel too, where `dot` took the AVX-512 VNNI one.
                #[cfg(target_arch = "x86_64")]
                if crate::model::linear::simd::Isa::current().has_avx2() {
                    // SAFETY: this CPU has AVX2, FMA and F16C; as above.
                    let avx2 = unsafe { x86::dot(&q, r, &xq, i) };
                    assert!(
                        (avx2 - want).abs() <= 1e-4 * want.abs().max(1.0),
                        "{format:?}"
                    );
                }
            }
        }
    }
}
