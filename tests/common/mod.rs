//! Shared helpers for the integration tests: fixture paths and reference files.
#![allow(dead_code)]

use candle_core::{DType, Device, Tensor};
use serde_json::Value;
use std::path::PathBuf;
use tiny_decoder::loader::{self, Loaded};
use tiny_decoder::KvCache;

pub const FIXTURES: [&str; 9] = [
    "llama-mha-tied",
    "llama-mqa-llama3",
    "mistral-gqa-headdim",
    "qwen2-bias",
    "qwen3-qknorm",
    "llama-linear-rope",
    "llama-yarn",
    "deepseek-v2",
    "deepseek-v3",
];

pub fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

pub fn reference(path: &std::path::Path) -> Value {
    let text = std::fs::read_to_string(path).expect("reference file");
    serde_json::from_str(&text).expect("reference json")
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id list")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

pub fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("float list")
        .iter()
        .map(|x| x.as_f64().expect("float") as f32)
        .collect()
}

pub fn load_dir(dir: &std::path::Path, dtype: DType) -> Loaded {
    let files = loader::resolve(dir.to_str().expect("utf-8 path")).expect("resolve");
    loader::load(&files, dtype, &Device::Cpu).expect("load")
}

/// Largest absolute difference between two equally long slices.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Logits (T, V) of one full-sequence forward.
pub fn full_logits(loaded: &Loaded, ids: &[u32]) -> Vec<Vec<f32>> {
    let model = &loaded.model;
    let mut cache = KvCache::new(model.config(), ids.len(), model.dtype(), model.device()).unwrap();
    let input = Tensor::new(ids, model.device())
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    model
        .forward(&input, &mut cache)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap()
}

/// Greedy continuation through the cache, ignoring EOS.
pub fn greedy(loaded: &Loaded, prompt: &[u32], n: usize) -> Vec<u32> {
    let model = &loaded.model;
    let mut cache = KvCache::new(
        model.config(),
        prompt.len() + n,
        model.dtype(),
        model.device(),
    )
    .unwrap();
    let mut logits = model.next_logits(prompt, &mut cache).unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        let next = tiny_decoder::sampling::argmax(&logits);
        out.push(next);
        logits = model.next_logits(&[next], &mut cache).unwrap();
    }
    out
}
