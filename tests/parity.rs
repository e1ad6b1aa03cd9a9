//! Golden tests against Hugging Face transformers: for every fixture built by
//! scripts/make_fixtures.py, our logits, greedy ids, tokenisation and NLL must match the
//! numbers transformers wrote into reference.json.

mod common;

use candle_core::{DType, Device};
use common::*;
use tiny_decoder::sampling::{Sampler, SamplingParams};
use tiny_decoder::{eval, generate, KvCache};

fn check_fixture(name: &str) {
    let dir = fixture_dir(name);
    let r = reference(&dir.join("reference.json"));
    let loaded = load_dir(&dir, DType::F32);
    let tok = loaded.tokenizer.as_ref().expect("tokenizer");

    // 1. Tokenisation of the prompt, special tokens included.
    let prompt = ids(&r["prompt_ids"]);
    let enc = tok.encode(r["prompt"].as_str().unwrap()).unwrap();
    assert_eq!(enc, prompt.as_slice(), "{name}: prompt tokenisation");

    // 2. Logits of every prompt position within 1e-4.
    let ours = full_logits(&loaded, &prompt);
    let theirs: Vec<Vec<f32>> = r["logits"].as_array().unwrap().iter().map(floats).collect();
    let diff = ours
        .iter()
        .zip(&theirs)
        .map(|(a, b)| max_abs_diff(a, b))
        .fold(0.0, f32::max);
    eprintln!("{name}: max logit diff {diff:.2e}");
    assert!(diff < 1e-4, "{name}: logits differ by {diff}");

    // 3. Greedy ids through the cache, without and with EOS stopping.
    let want = ids(&r["greedy_ids"]);
    assert_eq!(
        greedy(&loaded, &prompt, want.len()),
        want,
        "{name}: greedy ids"
    );
    let mut sampler = Sampler::new(&SamplingParams::default()).unwrap();
    let g = generate::generate(
        &loaded.model,
        tok.inner(),
        &prompt,
        want.len(),
        &mut sampler,
        |_| {},
    )
    .unwrap();
    // transformers keeps the EOS token it stopped at; our token_ids exclude it.
    let mut hf_ids = ids(&r["generate_ids"]);
    if hf_ids.len() < want.len() {
        let eos = hf_ids.pop().unwrap();
        assert!(
            loaded.model.config().eos_token_ids.contains(&eos),
            "{name}: stopped at {eos}"
        );
        assert_eq!(
            g.stop_reason,
            generate::StopReason::Eos,
            "{name}: stop reason"
        );
    }
    assert_eq!(g.token_ids, hf_ids, "{name}: generate ids (EOS stop)");

    // 4. Teacher-forced mean NLL within 2e-5.
    let eval_ids = ids(&r["eval_ids"]);
    let enc = tok.encode(r["eval_text"].as_str().unwrap()).unwrap();
    assert_eq!(enc, eval_ids.as_slice(), "{name}: eval tokenisation");
    let nll = eval::evaluate(&loaded.model, &eval_ids).unwrap();
    let want = r["mean_nll"].as_f64().unwrap();
    eprintln!("{name}: NLL diff {:.2e}", (nll.mean() - want).abs());
    assert!(
        (nll.mean() - want).abs() < 2e-5,
        "{name}: mean NLL {} vs {want}",
        nll.mean()
    );
    assert_eq!(nll.tokens, eval_ids.len() - 1);

    // 5. Token-by-token decode through the cache equals the full-sequence forward.
    let model = &loaded.model;
    let mut cache = KvCache::new(model.config(), prompt.len(), DType::F32, &Device::Cpu).unwrap();
    for (i, &id) in prompt.iter().enumerate() {
        let step = model.next_logits(&[id], &mut cache).unwrap();
        let diff = max_abs_diff(&step, &ours[i]);
        assert!(
            diff < 1e-4,
            "{name}: step {i} differs from the full forward by {diff}"
        );
    }
}

macro_rules! fixture_tests {
    ($($test:ident => $name:literal),* $(,)?) => {
        $(#[test] fn $test() { check_fixture($name); })*
    };
}

fixture_tests! {
    llama_mha_tied => "llama-mha-tied",
    llama_mqa_llama3_untied => "llama-mqa-llama3",
    mistral_gqa_head_dim => "mistral-gqa-headdim",
    qwen2_bias => "qwen2-bias",
    qwen3_qk_norm => "qwen3-qknorm",
    llama_linear_rope_bias => "llama-linear-rope",
    llama_yarn => "llama-yarn",
    deepseek_v2_mla_moe => "deepseek-v2",
    deepseek_v3_mla_moe_yarn => "deepseek-v3",
}
