//! Property test: loading a checkpoint whose config.json or safetensors header has been
//! mutated never panics; it loads or returns an error. A bounded number of cases runs in
//! `cargo test` (PROPTEST_CASES raises it).

mod common;

use candle_core::{DType, Device};
use proptest::prelude::*;
use serde_json::Value;
use std::path::PathBuf;
use tiny_decoder::loader;

const FIELDS: [&str; 10] = [
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "rope_parameters",
    "tie_word_embeddings",
];

fn scratch(case: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("fuzz")
        .join(case);
    std::fs::create_dir_all(&dir).unwrap();
    for name in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(
            common::fixture_dir("qwen3-qknorm").join(name),
            dir.join(name),
        )
        .unwrap();
    }
    dir
}

fn try_load(dir: &std::path::Path) {
    if let Ok(files) = loader::resolve(dir.to_str().unwrap()) {
        let _ = loader::load(&files, DType::F32, &Device::Cpu);
    }
}

fn json_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        (-3i64..300).prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| serde_json::json!(f)),
        "[a-z_]{0,8}".prop_map(Value::from),
        Just(serde_json::json!({"rope_type": "yarn"})),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn mutated_config_never_panics(edits in prop::collection::vec((0..FIELDS.len(), json_value()), 1..4)) {
        let dir = scratch("config");
        let path = dir.join("config.json");
        let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for (field, value) in edits {
            v[FIELDS[field]] = value;
        }
        std::fs::write(&path, v.to_string()).unwrap();
        try_load(&dir);
    }

    #[test]
    fn mutated_safetensors_never_panics(flips in prop::collection::vec((0usize..4096, any::<u8>()), 1..6), cut in 0usize..4) {
        let dir = scratch("safetensors");
        let path = dir.join("model.safetensors");
        let mut bytes = std::fs::read(&path).unwrap();
        let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        for (at, byte) in flips {
            let i = at % header; // inside the length prefix or the JSON header
            bytes[i] = byte;
        }
        if cut == 0 {
            bytes.truncate(header + 100);
        }
        std::fs::write(&path, bytes).unwrap();
        try_load(&dir);
    }
}
