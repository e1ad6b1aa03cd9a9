//! Bad input never panics: each broken checkpoint, impossible config or bad flag ends in a
//! one-line message on stderr that names the culprit, and a non-zero exit.

mod common;

use common::{edit_config, edit_header, fails, scratch};

use serde_json::Value;
use std::path::{Path, PathBuf};

fn generate(dir: &Path) -> Vec<String> {
    let d = dir.to_str().unwrap().to_string();
    vec![
        "generate".into(),
        "--model".into(),
        d,
        "--prompt".into(),
        "hi".into(),
        "--max-new-tokens".into(),
        "2".into(),
    ]
}

fn fails_generate(dir: &Path, expect: &str) -> String {
    let args = generate(dir);
    fails(
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        &[],
        expect,
    )
}

/// Renames a tensor in a header (the file stays well-formed, the name goes missing).
fn rename(h: &mut Value, from: &str, to: &str) {
    let map = h.as_object_mut().unwrap();
    let t = map.remove(from).unwrap();
    map.insert(to.to_string(), t);
}

#[test]
fn model_sources() {
    fails(
        &["info", "--model", "/no/such/dir"],
        &[],
        "no such model directory",
    );
    let home = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("empty-hf-home");
    let env = [("HF_HUB_OFFLINE", "1"), ("HF_HOME", home.to_str().unwrap())];
    fails(
        &["info", "--model", "someone/some-model"],
        &env,
        "HF_HUB_OFFLINE",
    );
    let dir = scratch("llama-mha-tied", "no-config");
    std::fs::remove_file(dir.join("config.json")).unwrap();
    fails_generate(&dir, "config.json");
    let dir = scratch("llama-mha-tied", "no-tokenizer");
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    fails_generate(&dir, "tokenizer.json");
    let dir = scratch("llama-mha-tied", "no-weights");
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    fails_generate(&dir, "safetensors");
    let dir = scratch("llama-mha-tied", "two-shards");
    std::fs::rename(dir.join("model.safetensors"), dir.join("a.safetensors")).unwrap();
    std::fs::copy(dir.join("a.safetensors"), dir.join("b.safetensors")).unwrap();
    fails_generate(&dir, "index");
}

#[test]
fn broken_configs() {
    let dir = scratch("llama-mha-tied", "config-not-json");
    std::fs::write(dir.join("config.json"), "{ not json").unwrap();
    fails_generate(&dir, "config.json");
    type Edit = Box<dyn Fn(&mut Value)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "zero",
            Box::new(|v| v["hidden_size"] = 0.into()),
            "hidden_size",
        ),
        (
            "negative",
            Box::new(|v| v["intermediate_size"] = (-4).into()),
            "intermediate_size",
        ),
        (
            "heads",
            Box::new(|v| v["num_key_value_heads"] = 3.into()),
            "num_key_value_heads",
        ),
        (
            "type",
            Box::new(|v| v["model_type"] = "gpt2".into()),
            "model_type",
        ),
        (
            "rope",
            Box::new(|v| v["rope_parameters"]["rope_type"] = "longrope".into()),
            "rope_type",
        ),
        (
            "layers",
            Box::new(|v| v["num_hidden_layers"] = 5.into()),
            "model.layers.2",
        ),
        (
            "vocab-embed",
            Box::new(|v| v["vocab_size"] = 500.into()),
            "embed_tokens",
        ),
        (
            "vocab-small",
            Box::new(|v| v["vocab_size"] = 100.into()),
            "embed_tokens",
        ),
    ];
    for (case, edit, expect) in cases {
        let dir = scratch("llama-mha-tied", &format!("config-{case}"));
        edit_config(&dir, edit);
        fails_generate(&dir, expect);
    }
}

#[test]
fn broken_safetensors() {
    let weights = |dir: &Path| dir.join("model.safetensors");
    let dir = scratch("llama-mha-tied", "st-empty");
    std::fs::write(weights(&dir), b"").unwrap();
    fails_generate(&dir, "model.safetensors");
    let dir = scratch("llama-mha-tied", "st-garbage");
    std::fs::write(
        weights(&dir),
        b"\x10\x00\x00\x00\x00\x00\x00\x00garbage garbage!",
    )
    .unwrap();
    fails_generate(&dir, "model.safetensors");
    let dir = scratch("llama-mha-tied", "st-truncated");
    let bytes = std::fs::read(weights(&dir)).unwrap();
    std::fs::write(weights(&dir), &bytes[..bytes.len() / 2]).unwrap();
    fails_generate(&dir, "model.safetensors");
    type Edit = Box<dyn Fn(&mut Value)>;
    let norm = "model.norm.weight";
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "missing",
            Box::new(move |h| rename(h, norm, "model.final_norm.weight")),
            norm,
        ),
        (
            "shape",
            Box::new(move |h| h[norm]["shape"] = serde_json::json!([32, 2])),
            norm,
        ),
        (
            "dtype",
            Box::new(move |h| h[norm]["dtype"] = "F16".into()),
            "model.safetensors",
        ),
        (
            "offsets",
            Box::new(move |h| h[norm]["data_offsets"] = serde_json::json!([0u64, 1u64 << 40])),
            "model.safetensors",
        ),
        (
            "unsupported",
            Box::new(move |h| h[norm]["dtype"] = "C64".into()),
            "model.safetensors",
        ),
    ];
    for (case, edit, expect) in cases {
        let dir = scratch("llama-mha-tied", &format!("st-{case}"));
        edit_header(&dir, edit);
        fails_generate(&dir, expect);
    }
}

#[test]
fn broken_tokenizers() {
    let dir = scratch("llama-mha-tied", "tok-not-json");
    std::fs::write(dir.join("tokenizer.json"), "nope").unwrap();
    fails_generate(&dir, "tokenizer.json");
    let dir = scratch("llama-mha-tied", "tok-unknown-model");
    let path = dir.join("tokenizer.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    v["model"]["type"] = "Quantum".into();
    std::fs::write(&path, v.to_string()).unwrap();
    fails_generate(&dir, "tokenizer.json");
}

#[test]
fn bad_flags() {
    let dir = common::fixture_dir("llama-mha-tied");
    let mut base = generate(&dir);
    let run = |extra: &[&str], expect: &str| {
        let mut args: Vec<&str> = base.iter().map(String::as_str).collect();
        args.extend_from_slice(extra);
        fails(&args, &[], expect);
    };
    run(&["--temperature", "-1"], "--temperature");
    run(&["--top-p", "0"], "--top-p");
    run(&["--top-p", "1.5"], "--top-p");
    run(&["--dtype", "f8"], "--dtype");
    run(&["--device", "tpu"], "--device");
    run(&["--device", "cuda"], "cuda");
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let schema = tmp.join("bad-schema.json");
    std::fs::write(&schema, r#"{"type": "object", "not": {}}"#).unwrap();
    let s = schema.to_str().unwrap();
    run(
        &["--json-schema", s],
        &format!("--json-schema {s}: invalid grammar"),
    );
    run(
        &["--json-schema", "/no/such.json"],
        "--json-schema /no/such.json: cannot read",
    );
    run(
        &["--grammar", s],
        &format!("--grammar {s}: invalid grammar"),
    );
    // clap's usage errors are printed whole: what is wrong, then the usage line.
    let mut args: Vec<&str> = base.iter().map(String::as_str).collect();
    args.push("--bogus");
    let out = std::process::Command::new(common::BIN)
        .args(&args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("'--bogus'") && stderr.contains("Usage:"),
        "{stderr}"
    );
    let long = "word ".repeat(400);
    base[4] = long;
    let args: Vec<&str> = base.iter().map(String::as_str).collect();
    fails(&args, &[], "context length is 256");

    let d = dir.to_str().unwrap();
    fails(
        &["eval", "--model", d, "--file", "/no/such/file.txt"],
        &[],
        "/no/such/file.txt",
    );
    let empty = tmp.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    fails(
        &["eval", "--model", d, "--file", empty.to_str().unwrap()],
        &[],
        "empty",
    );
    let binary = tmp.join("binary.txt");
    std::fs::write(&binary, [0xff, 0xfe, 0x00, 0x80]).unwrap();
    fails(
        &["eval", "--model", d, "--file", binary.to_str().unwrap()],
        &[],
        "UTF-8",
    );
}

#[test]
fn broken_mla_checkpoints() {
    let dir = scratch("deepseek-v3", "mla-no-kv-b");
    edit_header(&dir, |h| {
        rename(
            h,
            "model.layers.1.self_attn.kv_b_proj.weight",
            "unused.weight",
        )
    });
    fails_generate(&dir, "kv_b_proj");
    let dir = scratch("deepseek-v3", "mla-rank");
    edit_config(&dir, |v| v["kv_lora_rank"] = 48.into());
    fails_generate(&dir, "kv_b_proj.weight, expected: [128, 48]");
}
