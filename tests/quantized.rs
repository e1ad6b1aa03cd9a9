//! `--dtype q8_0|q4_0`: the layers' projections quantized at load to ggml's block formats.
//! A quantized product stays close to the dense one; every attention variant runs
//! quantized; `info` predicts the bytes a load takes; and on the real SmolLM2 the
//! quantized model's perplexity stays near the dense one's.

mod common;

use candle_core::quantized::GgmlDType;
use candle_core::{Device, Module, Tensor};
use common::{checkpoint, run_json};
use tiny_decoder::model::linear::Linear;

/// Relative error of a quantized product against the dense one, on random data.
fn relative_error(q: GgmlDType) -> f32 {
    let dev = Device::Cpu;
    let w = Tensor::randn(0f32, 1.0, (96, 256), &dev).unwrap();
    let x = Tensor::randn(0f32, 1.0, (3, 256), &dev).unwrap();
    let dense = Linear::new(w.clone(), None).forward(&x).unwrap();
    let mut quant = Linear::new(w, None);
    assert!(quant.quantize(&q).unwrap(), "{q:?}: not quantized");
    assert!(quant.weight().is_none());
    let got = quant.forward(&x).unwrap();
    let diff = (got - &dense).unwrap().sqr().unwrap().sum_all().unwrap();
    let norm = dense.sqr().unwrap().sum_all().unwrap();
    (diff.to_scalar::<f32>().unwrap() / norm.to_scalar::<f32>().unwrap()).sqrt()
}

#[test]
fn quantized_products_stay_close_to_dense_ones() {
    let (q8, q4) = (
        relative_error(GgmlDType::Q8_0),
        relative_error(GgmlDType::Q4_0),
    );
    // 8-bit weights and activations: under 1%; 4-bit weights: under 15%, and worse than 8.
    assert!(q8 < 0.01, "q8_0 relative error {q8}");
    assert!(q4 < 0.15 && q4 > q8, "q4_0 relative error {q4} (q8_0 {q8})");
    // Rows that are not whole blocks of 32 stay dense.
    let w = Tensor::zeros((4, 48), candle_core::DType::F32, &Device::Cpu).unwrap();
    let mut l = Linear::new(w, None);
    assert!(!l.quantize(&GgmlDType::Q8_0).unwrap());
    assert!(l.weight().is_some());
}

#[test]
fn every_bundled_variant_runs_quantized_and_info_predicts_its_bytes() {
    for m in ["tiny-mha", "tiny-gqa", "tiny-mqa", "tiny-mla"] {
        let dense = run_json(&[
            "bench",
            "-m",
            m,
            "--prompt-tokens",
            "8",
            "--new-tokens",
            "4",
        ]);
        for q in ["q8_0", "q4_0"] {
            let info = run_json(&["info", "-m", m, "--dtype", q]);
            let bench = run_json(&[
                "bench",
                "-m",
                m,
                "--dtype",
                q,
                "--prompt-tokens",
                "8",
                "--new-tokens",
                "4",
            ]);
            assert_eq!(bench["dtype"], q, "{m}");
            assert_eq!(info["dtype"], q, "{m}");
            assert_eq!(info["weight_bytes"], bench["weight_bytes"], "{m} {q}");
            assert!(
                bench["weight_bytes"].as_u64() < dense["weight_bytes"].as_u64(),
                "{m} {q}"
            );
            let g = run_json(&[
                "generate", "-m", m, "--dtype", q, "-p", "ROMEO:", "-t", "0", "-n", "8",
            ]);
            assert!(!g["token_ids"].as_array().unwrap().is_empty(), "{m} {q}");
        }
    }
}

#[test]
fn smollm2_quantized_perplexity_stays_near_f32() {
    let Some(dir) = checkpoint("smollm2-135m-instruct") else {
        return;
    };
    let (m, passage) = (dir.to_str().unwrap(), "tests/data/passage.txt");
    let file = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(passage);
    let nll = |dtype: &str| {
        let v = run_json(&[
            "eval",
            "-m",
            m,
            "--file",
            file.to_str().unwrap(),
            "--dtype",
            dtype,
        ]);
        assert_eq!(v["dtype"], dtype);
        v["mean_nll"].as_f64().unwrap()
    };
    let (f32, q8, q4) = (nll("f32"), nll("q8_0"), nll("q4_0"));
    eprintln!("mean NLL f32 {f32:.5}, q8_0 {q8:.5}, q4_0 {q4:.5}");
    // llama.cpp's Q8_0 is near-lossless (ΔNLL ~0.001-0.01); Q4_0 costs more.
    assert!((q8 - f32).abs() < 0.02, "q8_0 {q8} vs f32 {f32}");
    assert!(
        q4 - f32 < 0.3 && q4 > q8 - 0.01,
        "q4_0 {q4} vs f32 {f32}, q8_0 {q8}"
    );
    // (No greedy text here: on "What is the capital of France?" f32's first token "The" leads
    // "L" by 0.08 logits, a margin Q8_0's rounding may flip; the NLL is the measure.)
}

/// Our Q8_0/Q4_0 kernels against candle's quantized matmul on the same weights: the weights
/// quantize the same way (ggml's reference), so only the activations' scales differ (ours
/// f32, candle's f16).
#[test]
fn our_block_products_match_candles() {
    let dev = Device::Cpu;
    let w = Tensor::randn(0f32, 1.0, (64, 576), &dev).unwrap();
    let x = Tensor::randn(0f32, 1.0, (2, 576), &dev).unwrap();
    for q in [GgmlDType::Q8_0, GgmlDType::Q4_0] {
        let mut ours = Linear::new(w.clone(), None);
        ours.quantize(&q).unwrap();
        let ours = ours.forward(&x).unwrap();
        let theirs = candle_core::quantized::QTensor::quantize(&w, q).unwrap();
        let theirs = x.apply_op1_no_bwd(&theirs).unwrap();
        let diff = (&ours - &theirs).unwrap().abs().unwrap().max_all().unwrap();
        let scale = theirs.abs().unwrap().max_all().unwrap();
        let (diff, scale) = (
            diff.to_scalar::<f32>().unwrap(),
            scale.to_scalar::<f32>().unwrap(),
        );
        assert!(
            diff < 2e-3 * scale,
            "{q:?}: max diff {diff} (outputs up to {scale})"
        );
    }
}
