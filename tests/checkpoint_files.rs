//! A checkpoint loads as its authors meant it: its own dtype (`--dtype auto`), its
//! tokenizer_config.json, chat template and generation_config.json; quantized checkpoints
//! are refused by name; `info` reads headers only; absurd sizes are errors, not aborts.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{edit_config, edit_header, fails, run_json, scratch, BIN};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::Path;
use std::process::Command;
use tiny_decoder::loader::{self, DTypeArg};

fn load(dir: &Path, dtype: DTypeArg) -> loader::Loaded {
    let files = loader::resolve(dir.to_str().unwrap()).unwrap();
    loader::load(&files, dtype, &Device::Cpu).unwrap()
}

/// Rewrites `dir/model.safetensors` with every tensor in `dtype`, and config.json's `dtype`.
fn convert(dir: &Path, dtype: DType, name: &str) {
    let path = dir.join("model.safetensors");
    let tensors = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let converted: HashMap<String, Tensor> = tensors
        .into_iter()
        .map(|(k, t)| (k, t.to_dtype(dtype).unwrap()))
        .collect();
    candle_core::safetensors::save(&converted, &path).unwrap();
    edit_config(dir, |v| v["dtype"] = name.into());
}

#[test]
fn dtype_auto_keeps_the_checkpoint_dtype() {
    let f32_dir = scratch("llama-mha-tied", "files-f32");
    let bf16_dir = scratch("llama-mha-tied", "files-bf16");
    convert(&bf16_dir, DType::BF16, "bfloat16");
    let f16_dir = scratch("llama-mha-tied", "files-f16");
    convert(&f16_dir, DType::F16, "float16");
    for (dir, want, stored) in [
        (&f32_dir, "f32", "f32"),
        (&bf16_dir, "bf16", "bf16"),
        // f16 runs as f32 on CPU (exact widening; no fast f16 CPU path).
        (&f16_dir, "f32", "f16"),
    ] {
        let d = dir.to_str().unwrap();
        let info = run_json(&["info", "--model", d]);
        assert_eq!(info["dtype"], want, "{d}: {info}");
        assert_eq!(info["checkpoint_dtype"], stored, "{d}: {info}");
        let gen = run_json(&["generate", "-m", d, "-p", "hi", "-n", "3"]);
        assert_eq!(gen["dtype"], want, "{d}: {gen}");
        let loaded = load(dir, DTypeArg::Auto);
        assert_eq!(loaded.model.dtype().as_str(), want);
    }
    // An explicit --dtype still wins.
    let info = run_json(&["info", "-m", bf16_dir.to_str().unwrap(), "--dtype", "f32"]);
    assert_eq!(info["dtype"], "f32");
    // The bytes win over a config.json that names another dtype.
    edit_config(&bf16_dir, |v| v["dtype"] = "float32".into());
    assert_eq!(load(&bf16_dir, DTypeArg::Auto).model.dtype(), DType::BF16);
}

#[test]
fn quantized_checkpoints_are_refused_by_name() {
    let dir = scratch("llama-mha-tied", "files-gptq-config");
    edit_config(&dir, |v| {
        v["quantization_config"] = json!({"quant_method": "gptq", "bits": 4, "group_size": 128})
    });
    let args = ["generate", "-m", dir.to_str().unwrap(), "-p", "hi"];
    let msg = fails(&args, &[], "gptq (4-bit)");
    assert!(msg.contains("unquantized"), "{msg}");
    fails(&["info", "-m", dir.to_str().unwrap()], &[], "gptq");

    let norm = "model.norm.weight";
    type Edit = Box<dyn Fn(&mut Value)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "qweight",
            Box::new(move |h| {
                let mut t = h[norm].clone();
                t["dtype"] = "I32".into();
                h["model.layers.0.self_attn.q_proj.qweight"] = t;
            }),
            "q_proj.qweight is packed GPTQ/AWQ",
        ),
        (
            "scales",
            Box::new(move |h| h["model.layers.0.mlp.up_proj.scales"] = h[norm].clone()),
            "up_proj.scales is packed GPTQ/AWQ",
        ),
        (
            "fp8",
            Box::new(move |h| {
                h[norm]["dtype"] = "F8_E4M3".into();
                h[norm]["shape"] = json!([256]); // the same 256 bytes, read as FP8
            }),
            "F8_E4M3, an 8-bit float (FP8-quantized)",
        ),
        (
            "int8",
            Box::new(move |h| {
                h[norm]["dtype"] = "I8".into();
                h[norm]["shape"] = json!([256]);
            }),
            "dtype I8",
        ),
    ];
    for (case, edit, expect) in cases {
        let dir = scratch("llama-mha-tied", &format!("files-{case}"));
        edit_header(&dir, edit);
        fails(
            &["generate", "-m", dir.to_str().unwrap(), "-p", "hi"],
            &[],
            expect,
        );
    }
}

#[test]
fn stop_ids_come_from_generation_config_then_config_then_tokenizer() {
    let dir = scratch("llama-mha-tied", "files-eos");
    let gen = dir.join("generation_config.json");
    std::fs::write(&gen, r#"{"eos_token_id": [1, 5, 7]}"#).unwrap();
    let eos = |d: &Path| load(d, DTypeArg::Auto).model.config().eos_token_ids.clone();
    assert_eq!(eos(&dir), vec![1, 5, 7]);
    std::fs::write(&gen, r#"{"eos_token_id": 9}"#).unwrap();
    assert_eq!(eos(&dir), vec![9]);
    std::fs::remove_file(&gen).unwrap();
    edit_config(&dir, |v| v["eos_token_id"] = json!([1, 2]));
    assert_eq!(eos(&dir), vec![1, 2]);
    edit_config(&dir, |v| v["eos_token_id"] = Value::Null);
    assert_eq!(eos(&dir), Vec::<u32>::new());
    let tc = dir.join("tokenizer_config.json");
    std::fs::write(
        &tc,
        r#"{"eos_token": {"content": "</s>", "special": true}}"#,
    )
    .unwrap();
    assert_eq!(eos(&dir), vec![1], "the tokenizer's eos_token </s>");

    // With none, generation runs to its length and says so once.
    std::fs::remove_file(&tc).unwrap();
    let out = Command::new(BIN)
        .args([
            "generate",
            "-m",
            dir.to_str().unwrap(),
            "-p",
            "hi",
            "-n",
            "5",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr.matches("names no end-of-sequence token").count(),
        1,
        "{stderr}"
    );
}

#[test]
fn tokenizer_config_and_chat_template_are_honoured() {
    let dir = scratch("llama-mha-tied", "files-tokenizer-config");
    let text = "hello world";
    // tokenizer.json's post-processor puts <s> (id 0) first.
    let with_bos = load(&dir, DTypeArg::Auto)
        .tokenizer
        .unwrap()
        .encode(text)
        .unwrap();
    assert_eq!(with_bos[0], 0);
    let tc = dir.join("tokenizer_config.json");
    let write = |v: Value| std::fs::write(&tc, v.to_string()).unwrap();
    write(json!({"add_bos_token": false, "bos_token": "<s>", "eos_token": "</s>"}));
    let loaded = load(&dir, DTypeArg::Auto);
    let tok = loaded.tokenizer.as_ref().unwrap();
    assert_eq!(tok.encode(text).unwrap(), with_bos[1..].to_vec());
    write(json!({"add_bos_token": true, "add_eos_token": true,
                 "bos_token": "<s>", "eos_token": {"content": "</s>"}}));
    let tok = load(&dir, DTypeArg::Auto).tokenizer.unwrap();
    let mut want = with_bos.clone();
    want.push(1);
    assert_eq!(tok.encode(text).unwrap(), want);
    write(json!({"add_bos_token": true, "bos_token": "<nope>"}));
    let files = loader::resolve(dir.to_str().unwrap()).unwrap();
    let err = loader::load(&files, DTypeArg::Auto, &Device::Cpu)
        .err()
        .unwrap();
    assert!(err.to_string().contains("<nope>"), "{err}");

    // The chat template: tokenizer_config.json's (one, or the `default` of several) ...
    write(json!({"chat_template": "{{ messages }}"}));
    let meta = load(&dir, DTypeArg::Auto).meta;
    assert_eq!(meta.chat_template.as_deref(), Some("{{ messages }}"));
    write(
        json!({"chat_template": [{"name": "tool_use", "template": "T"},
                                   {"name": "default", "template": "D"}]}),
    );
    assert_eq!(
        load(&dir, DTypeArg::Auto).meta.chat_template.as_deref(),
        Some("D")
    );
    // ... and chat_template.jinja beside it wins, as in transformers 5.
    std::fs::write(dir.join("chat_template.jinja"), "J").unwrap();
    assert_eq!(
        load(&dir, DTypeArg::Auto).meta.chat_template.as_deref(),
        Some("J")
    );
}

#[test]
fn info_reads_headers_only() {
    for name in common::FIXTURES {
        let files = loader::resolve(common::fixture_dir(name).to_str().unwrap()).unwrap();
        let source = loader::Source::Files(files.clone());
        let described = source.describe(DTypeArg::Auto, &Device::Cpu).unwrap();
        let loaded = loader::load(&files, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(described.num_parameters, loaded.num_parameters, "{name}");
    }
    // Weights cut off after the header: info and generate both refuse it from the header's
    // byte ranges against the file's size, naming the tensor.
    let dir = scratch("llama-mha-tied", "files-info-truncated");
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    std::fs::write(&path, &bytes[..8 + n + 16]).unwrap();
    let m = dir.to_str().unwrap();
    let cut = "are not inside the 16 bytes of data";
    fails(&["info", "-m", m], &[], cut);
    fails(&["generate", "-m", m, "-p", "hi"], &[], cut);
    // A shape whose product wraps (2^62 rows of 4 bytes) is refused, not counted as 0 bytes.
    let dir = scratch("llama-mha-tied", "files-info-huge");
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    header["model.norm.weight"]["shape"] = serde_json::json!([1u64 << 62, 4]);
    let text = header.to_string();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text.as_bytes());
    out.extend(&bytes[8 + n..]);
    std::fs::write(&path, out).unwrap();
    fails(
        &["info", "-m", dir.to_str().unwrap()],
        &[],
        "model.norm.weight",
    );
}

#[test]
fn absurd_sizes_are_refused_before_allocating() {
    let dir = scratch("llama-mha-tied", "files-absurd");
    edit_config(&dir, |v| {
        v["vocab_size"] = 16_000_000.into();
        v["hidden_size"] = 16_000_000.into();
        v["num_attention_heads"] = 1.into();
        v["num_key_value_heads"] = 1.into();
        v["head_dim"] = 16.into();
    });
    let config = dir.join("config.json");
    fails(
        &["bench", "--config", config.to_str().unwrap()],
        &[],
        "lower vocab_size, hidden_size",
    );
    // A context of 16M positions: the cache for it is refused before it is allocated.
    let dir = scratch("llama-mha-tied", "files-absurd-context");
    edit_config(&dir, |v| {
        v["max_position_embeddings"] = 16_000_000.into();
        v["num_attention_heads"] = 32.into();
        v["num_key_value_heads"] = 32.into();
        v["head_dim"] = 128.into();
    });
    let config = dir.join("config.json");
    let c = config.to_str().unwrap();
    let args = [
        "bench",
        "--config",
        c,
        "--prompt-tokens",
        "15000000",
        "--new-tokens",
        "1",
    ];
    fails(&args, &[], "KV cache");
}

#[test]
fn clap_errors_are_printed_whole() {
    let out = Command::new(BIN)
        .args(["eval", "--model", "tiny-gqa"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--file <FILE>"), "{stderr}");
    assert!(stderr.contains("Usage:"), "{stderr}");
}
