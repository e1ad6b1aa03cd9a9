//! MLA: the absorbed decode over the latent cache equals attention over up-projected K/V,
//! and the cache holds exactly kv_lora_rank + qk_rope_head_dim values per token per layer.

mod common;

use candle_core::{DType, Device};
use common::*;
use tiny_decoder::config::AttentionConfig;
use tiny_decoder::sampling::{Sampler, SamplingParams};
use tiny_decoder::{generate, KvCache};

/// Feeds `ids` one at a time and returns each step's logits.
fn decode_steps(
    loaded: &tiny_decoder::loader::Loaded,
    ids: &[u32],
    mut cache: KvCache,
) -> Vec<Vec<f32>> {
    ids.iter()
        .map(|&id| loaded.model.next_logits(&[id], &mut cache).unwrap())
        .collect()
}

#[test]
fn absorbed_decode_equals_expanded_cache() {
    for name in ["deepseek-v2", "deepseek-v3"] {
        let dir = fixture_dir(name);
        let r = reference(&dir.join("reference.json"));
        let loaded = load_dir(&dir, DType::F32);
        let cfg = loaded.model.config();
        let ids = ids(&r["eval_ids"]);
        let latent = KvCache::new(cfg, ids.len(), DType::F32, &Device::Cpu).unwrap();
        let expanded = KvCache::expanded(cfg, ids.len(), DType::F32, &Device::Cpu).unwrap();
        assert!(expanded.bytes_per_token() > latent.bytes_per_token());
        let a = decode_steps(&loaded, &ids, latent);
        let b = decode_steps(&loaded, &ids, expanded);
        let full = full_logits(&loaded, &ids);
        for (i, ((a, b), f)) in a.iter().zip(&b).zip(&full).enumerate() {
            assert!(
                max_abs_diff(a, b) < 1e-4,
                "{name} step {i}: absorbed vs expanded {}",
                max_abs_diff(a, b)
            );
            assert!(
                max_abs_diff(a, f) < 1e-4,
                "{name} step {i}: absorbed vs full {}",
                max_abs_diff(a, f)
            );
        }
    }
}

#[test]
fn prefill_then_absorbed_decode_matches_reference_greedy() {
    // A prompt through the expanded form, then absorbed single-token steps: transformers' ids.
    for name in ["deepseek-v2", "deepseek-v3"] {
        let dir = fixture_dir(name);
        let r = reference(&dir.join("reference.json"));
        let loaded = load_dir(&dir, DType::F32);
        let want = ids(&r["greedy_ids"]);
        assert_eq!(
            greedy(&loaded, &ids(&r["prompt_ids"]), want.len()),
            want,
            "{name}"
        );
    }
}

#[test]
fn latent_cache_bytes_follow_the_formula() {
    let dir = fixture_dir("deepseek-v3");
    let r = reference(&dir.join("reference.json"));
    let loaded = load_dir(&dir, DType::F32);
    let cfg = loaded.model.config();
    let AttentionConfig::Mla(m) = &cfg.attention else {
        panic!("not MLA")
    };
    let per_token = cfg.num_hidden_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * 4;
    assert_eq!(per_token, 3 * (32 + 8) * 4);
    let prompt = ids(&r["prompt_ids"]);
    let mut sampler = Sampler::new(&SamplingParams::default()).unwrap();
    let tok = loaded.tokenizer.as_ref().unwrap();
    let g = generate::generate(
        &loaded.model,
        tok.inner(),
        &prompt,
        10,
        &mut sampler,
        |_| {},
    )
    .unwrap();
    assert_eq!(g.kv_bytes_per_token, per_token);
    // The last sampled token is never fed back, so the cache holds prompt + generated - 1.
    assert_eq!(
        g.kv_cache_bytes,
        (prompt.len() + g.token_ids.len() - 1) * per_token
    );
    // MHA with the same heads would cache H·(nope + rope + v) per layer.
    assert_eq!(cfg.mha_values_per_token_per_layer(), 4 * (16 + 8 + 16));
}
