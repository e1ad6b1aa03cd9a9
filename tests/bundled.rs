//! The models compiled into the binary: each loads and generates deterministically, and
//! `eval` on the committed held-out Shakespeare slice reproduces the perplexity recorded by
//! scripts/train_tiny.py (transformers) within 1%, better than a unigram model.

use candle_core::{DType, Device};
use std::path::PathBuf;
use tiny_decoder::loader::{bundled, load_bundled};
use tiny_decoder::sampling::{Sampler, SamplingParams};
use tiny_decoder::{eval, generate};

fn training_record(name: &str) -> serde_json::Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("models")
        .join(name)
        .join("training.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn bundled_models_generate_deterministically() {
    assert!(bundled::find(bundled::DEFAULT).is_some());
    for b in &bundled::MODELS {
        let loaded = load_bundled(b, DType::F32, &Device::Cpu).unwrap();
        let tok = loaded.tokenizer.as_ref().unwrap();
        let prompt = tok.encode("ROMEO:").unwrap();
        let run = || {
            let mut sampler = Sampler::new(&SamplingParams::default()).unwrap();
            generate::generate(
                &loaded.model,
                tok.inner(),
                &prompt,
                24,
                &mut sampler,
                |_| {},
            )
            .unwrap()
        };
        let (a, b2) = (run(), run());
        assert!(!a.token_ids.is_empty(), "{}: nothing generated", b.name);
        assert_eq!(
            a.token_ids, b2.token_ids,
            "{}: greedy output differs run to run",
            b.name
        );
        // Seeded sampling is reproducible too.
        let params = SamplingParams {
            temperature: 0.8,
            top_p: 0.95,
            seed: 11,
            ..Default::default()
        };
        let sample = || {
            let mut s = Sampler::new(&params).unwrap();
            generate::generate(&loaded.model, tok.inner(), &prompt, 24, &mut s, |_| {})
                .unwrap()
                .token_ids
        };
        assert_eq!(sample(), sample(), "{}: seeded sampling differs", b.name);
    }
}

#[test]
fn bundled_models_reproduce_recorded_perplexity() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/shakespeare-heldout.txt");
    let text = std::fs::read_to_string(path).unwrap();
    for b in &bundled::MODELS {
        let record = training_record(b.name);
        let loaded = load_bundled(b, DType::F32, &Device::Cpu).unwrap();
        let ids = loaded.tokenizer.as_ref().unwrap().encode(&text).unwrap();
        let nll = eval::evaluate(&loaded.model, &ids).unwrap();
        let want = record["heldout_perplexity"].as_f64().unwrap();
        let unigram = record["unigram_heldout_perplexity"].as_f64().unwrap();
        eprintln!(
            "{}: perplexity {:.3} (recorded {want:.3}, unigram {unigram:.1})",
            b.name,
            nll.perplexity()
        );
        assert_eq!(
            nll.tokens as u64,
            record["heldout_predicted_tokens"].as_u64().unwrap()
        );
        assert!(
            (nll.perplexity() / want - 1.0).abs() < 0.01,
            "{}: {} vs {want}",
            b.name,
            nll.perplexity()
        );
        assert!(
            nll.perplexity() < unigram,
            "{}: no better than unigram",
            b.name
        );
    }
}
