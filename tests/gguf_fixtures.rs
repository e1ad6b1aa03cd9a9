//! GGUF input without the real checkpoint: three fixtures of tests/fixtures (Llama tied,
//! Llama untied with attention biases and linear RoPE scaling, Qwen2 with q/k/v biases)
//! written here as llama.cpp's converter writes them (its tensor names, F32 blocks, Llama's
//! q/k rows permuted, the byte-level tokenizer as `gpt2` metadata), loaded back and compared
//! with the directory they came from; and bad files, each refused in one line.

mod common;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use common::{fails, fixture_dir, full_logits, load_dir, max_abs_diff};
use std::path::{Path, PathBuf};
use tiny_decoder::loader::{self, gguf::GgufFile, DTypeArg, Loaded};

/// Hugging Face per-layer module → llama.cpp name (gguf-py's `TENSOR_NAMES`).
const LAYER: [(&str, &str); 9] = [
    ("input_layernorm", "attn_norm"),
    ("post_attention_layernorm", "ffn_norm"),
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
];

fn llama_cpp_name(hf: &str) -> String {
    match hf {
        "model.embed_tokens.weight" => return "token_embd.weight".into(),
        "model.norm.weight" => return "output_norm.weight".into(),
        "lm_head.weight" => return "output.weight".into(),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.").expect(hf);
    let (layer, rest) = rest.split_once('.').unwrap();
    let (module, param) = rest.rsplit_once('.').unwrap();
    let (_, name) = LAYER.iter().find(|(h, _)| *h == module).expect(hf);
    format!("blk.{layer}.{name}.{param}")
}

/// convert_hf_to_gguf.py's `LlamaModel.permute` on q/k rows: each head's rotary halves
/// interleaved into pairs, (H, 2, half) → (H, half, 2).
fn permute(w: &Tensor, heads: usize) -> Tensor {
    let dims = w.dims().to_vec();
    let mut split = vec![heads, 2, dims[0] / heads / 2];
    split.extend_from_slice(&dims[1..]);
    let t = w.reshape(split).unwrap().transpose(1, 2).unwrap();
    t.contiguous().unwrap().reshape(dims).unwrap()
}

fn strings(items: impl IntoIterator<Item = String>) -> Value {
    Value::Array(items.into_iter().map(Value::String).collect())
}

/// The fixture's tokenizer.json as `tokenizer.ggml.*` metadata (byte-level BPE: `gpt2`).
fn tokenizer_metadata(dir: &Path, meta: &mut Vec<(String, Value)>) {
    let tok = common::reference(&dir.join("tokenizer.json"));
    let vocab = tok["model"]["vocab"].as_object().unwrap();
    let mut tokens = vec![String::new(); vocab.len()];
    for (t, id) in vocab {
        tokens[id.as_u64().unwrap() as usize] = t.clone();
    }
    let special: Vec<u64> = tok["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_u64().unwrap())
        .collect();
    let types =
        (0..tokens.len() as u64).map(|i| Value::I32(if special.contains(&i) { 3 } else { 1 }));
    let merges = tok["model"]["merges"].as_array().unwrap().iter().map(|m| {
        let pair: Vec<&str> = m
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_str().unwrap())
            .collect();
        pair.join(" ")
    });
    let adds_bos = !tok["post_processor"]["special_tokens"]
        .as_object()
        .unwrap()
        .is_empty();
    meta.extend([
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("default".into())),
        ("tokenizer.ggml.tokens".into(), strings(tokens)),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(types.collect()),
        ),
        ("tokenizer.ggml.merges".into(), strings(merges)),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(0)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(1)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(adds_bos)),
    ]);
}

/// Writes fixture `name` as a GGUF file, after `edit` has changed its metadata.
fn to_gguf(name: &str, file: &str, edit: impl Fn(&mut Vec<(String, Value)>)) -> PathBuf {
    let dir = fixture_dir(name);
    let cfg = common::reference(&dir.join("config.json"));
    let arch = cfg["model_type"].as_str().unwrap();
    let int = |k: &str| Value::U32(cfg[k].as_u64().unwrap() as u32);
    let key = |k: &str| format!("{arch}.{k}");
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (key("block_count"), int("num_hidden_layers")),
        (key("context_length"), int("max_position_embeddings")),
        (key("embedding_length"), int("hidden_size")),
        (key("feed_forward_length"), int("intermediate_size")),
        (key("attention.head_count"), int("num_attention_heads")),
        (key("attention.head_count_kv"), int("num_key_value_heads")),
        (key("vocab_size"), int("vocab_size")),
    ];
    let f32_of = |v: &serde_json::Value| Value::F32(v.as_f64().unwrap() as f32);
    meta.push((
        key("attention.layer_norm_rms_epsilon"),
        f32_of(&cfg["rms_norm_eps"]),
    ));
    let rope = if cfg["rope_parameters"].is_object() {
        &cfg["rope_parameters"]
    } else {
        &cfg
    };
    meta.push((key("rope.freq_base"), f32_of(&rope["rope_theta"])));
    if rope["rope_type"] == "linear" {
        meta.push((key("rope.scaling.type"), Value::String("linear".into())));
        meta.push((key("rope.scaling.factor"), f32_of(&rope["factor"])));
    }
    tokenizer_metadata(&dir, &mut meta);
    edit(&mut meta);
    let heads = cfg["num_attention_heads"].as_u64().unwrap() as usize;
    let kv_heads = cfg["num_key_value_heads"].as_u64().unwrap() as usize;
    let hf = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut tensors: Vec<(String, QTensor)> = hf
        .iter()
        .map(|(name, t)| {
            let gname = llama_cpp_name(name);
            let t = match (arch, gname.contains(".attn_q."), gname.contains(".attn_k.")) {
                ("llama", true, _) => permute(t, heads),
                ("llama", _, true) => permute(t, kv_heads),
                _ => t.clone(),
            };
            (gname, QTensor::quantize(&t, GgmlDType::F32).unwrap())
        })
        .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(file);
    let mut w = std::fs::File::create(&out).unwrap();
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    gguf_file::write(&mut w, &meta_refs, &tensor_refs).unwrap();
    out
}

fn load_gguf(path: &Path) -> Loaded {
    let source = loader::open(path.to_str().unwrap()).unwrap();
    source.load(DTypeArg::Auto, &Device::Cpu).unwrap()
}

const TEXTS: [&str; 4] = [
    "ROMEO: But soft, what light",
    "  two  spaces\nand a line",
    "<s>literal special</s> tokens",
    "",
];

#[test]
fn gguf_fixtures_load_as_their_directories() {
    for fixture in ["llama-mha-tied", "llama-linear-rope", "qwen2-bias"] {
        let path = to_gguf(fixture, &format!("{fixture}.gguf"), |_| {});
        let dir = fixture_dir(fixture);
        let (ours, theirs) = (load_gguf(&path), load_dir(&dir, DType::F32));
        // The metadata's rms_norm_eps is an f32 (1e-6 rounded); all else is equal.
        let mut cfg = ours.model.config().clone();
        assert!((cfg.rms_norm_eps - theirs.model.config().rms_norm_eps).abs() < 1e-12);
        cfg.rms_norm_eps = theirs.model.config().rms_norm_eps;
        assert_eq!(&cfg, theirs.model.config(), "{fixture}: config");
        assert_eq!(ours.num_parameters, theirs.num_parameters, "{fixture}");
        let (tok, want) = (
            ours.tokenizer.as_ref().unwrap(),
            theirs.tokenizer.as_ref().unwrap(),
        );
        for text in TEXTS {
            assert_eq!(
                tok.encode(text).unwrap(),
                want.encode(text).unwrap(),
                "{fixture}: {text:?}"
            );
        }
        let r = common::reference(&dir.join("reference.json"));
        let prompt = common::ids(&r["prompt_ids"]);
        assert_eq!(
            tok.encode(r["prompt"].as_str().unwrap()).unwrap(),
            prompt,
            "{fixture}"
        );
        let (a, b) = (full_logits(&ours, &prompt), full_logits(&theirs, &prompt));
        for (x, y) in a.iter().zip(&b) {
            assert!(max_abs_diff(x, y) < 1e-4, "{fixture}: logits differ");
        }
        let want = common::ids(&r["greedy_ids"]);
        assert_eq!(
            common::greedy(&ours, &prompt, want.len()),
            want,
            "{fixture}: greedy"
        );
    }
}

#[test]
fn gguf_info_and_generate_run_from_the_cli() {
    let path = to_gguf("qwen2-bias", "cli-qwen2.gguf", |_| {});
    let arg = path.to_str().unwrap();
    let info = common::run_json(&["info", "-m", arg]);
    assert_eq!(info["model_type"], "qwen2");
    assert_eq!(info["dtype"], "f32");
    assert_eq!(info["checkpoint_dtype"], "f32");
    let out = common::run_json(&[
        "generate", "-m", arg, "-p", "ROMEO:", "-n", "4", "-t", "0", "--dtype", "bf16",
    ]);
    assert_eq!(out["dtype"], "bf16");
    assert!(out["token_ids"].as_array().unwrap().len() <= 4);
}

/// Tokenizer-only GGUFs against transformers' tokenizer for the same file
/// (scripts/gguf_tokenizer_reference.py): a SentencePiece-style (`llama`) vocabulary with
/// no merges (rebuilt from the scores), and one byte-level vocabulary under three split
/// regexes (`tokenizer.ggml.pre`), with merges that only some of them let apply.
#[test]
fn gguf_tokenizers_match_transformers() {
    let data = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/gguf");
    for (name, n) in [
        ("sentencepiece-512", 10),
        ("bytelevel-default", 7),
        ("bytelevel-qwen2", 7),
        ("bytelevel-llama-bpe", 7),
    ] {
        let gguf = GgufFile::open(&data.join(format!("{name}.gguf"))).unwrap();
        let tok = gguf.tokenizer().unwrap().unwrap();
        let r = common::reference(&data.join(format!("{name}.json")));
        let cases = r["cases"].as_array().unwrap();
        assert_eq!(cases.len(), n, "{name}");
        for case in cases {
            let text = case["text"].as_str().unwrap();
            let want = common::ids(&case["ids"]);
            assert_eq!(tok.encode(text).unwrap(), want, "{name}: {text:?}");
            let decoded = tok.inner().decode(&want, true).unwrap();
            assert_eq!(
                decoded,
                case["decoded"].as_str().unwrap(),
                "{name}: {text:?}"
            );
        }
    }
}

/// A change to a GGUF's metadata before it is written.
type Edit = Box<dyn Fn(&mut Vec<(String, Value)>)>;

fn without(key: &'static str) -> impl Fn(&mut Vec<(String, Value)>) {
    move |meta| meta.retain(|(k, _)| k != key)
}

fn set(key: &'static str, value: Value) -> impl Fn(&mut Vec<(String, Value)>) {
    move |meta| {
        meta.retain(|(k, _)| k != key);
        meta.push((key.into(), value.clone()));
    }
}

#[test]
fn gguf_bad_files_are_one_line_naming_file_and_key() {
    let s = |x: &str| Value::String(x.into());
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "no-layers",
            Box::new(without("llama.block_count")),
            "metadata key llama.block_count is missing",
        ),
        (
            "gemma",
            Box::new(set("general.architecture", s("gemma2"))),
            "general.architecture is \"gemma2\"",
        ),
        (
            "no-arch",
            Box::new(without("general.architecture")),
            "metadata key general.architecture is missing",
        ),
        (
            "heads-str",
            Box::new(set("llama.attention.head_count", s("4"))),
            "llama.attention.head_count is a string, expected an integer",
        ),
        (
            "bert-tok",
            Box::new(set("tokenizer.ggml.model", s("bert"))),
            "tokenizer.ggml.model is \"bert\"",
        ),
        (
            "yarn",
            Box::new(set("llama.rope.scaling.type", s("yarn"))),
            "llama.rope.scaling.type is \"yarn\"",
        ),
        (
            "bad-eos",
            Box::new(set("tokenizer.ggml.eos_token_id", Value::U32(9999))),
            "tokenizer.ggml.eos_token_id is 9999",
        ),
    ];
    for (case, edit, expect) in cases {
        let path = to_gguf("llama-mha-tied", &format!("bad-{case}.gguf"), edit);
        let arg = path.to_str().unwrap();
        let stderr = fails(&["generate", "-m", arg, "-p", "hi"], &[], expect);
        assert!(stderr.contains(arg), "{case}: {stderr}");
    }
    // Truncated: inside the tensor data, and inside the metadata.
    let path = to_gguf("llama-mha-tied", "whole.gguf", |_| {});
    let bytes = std::fs::read(&path).unwrap();
    for (case, len, expect) in [
        ("data", bytes.len() - 100, "truncated or corrupt: tensor "),
        ("header", 200, "not a valid GGUF file"),
    ] {
        let cut = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("cut-{case}.gguf"));
        std::fs::write(&cut, &bytes[..len]).unwrap();
        let arg = cut.to_str().unwrap();
        for args in [
            &["info", "-m", arg][..],
            &["generate", "-m", arg, "-p", "hi"],
        ] {
            let stderr = fails(args, &[], expect);
            assert!(stderr.contains(arg), "{case}: {stderr}");
        }
    }
}
