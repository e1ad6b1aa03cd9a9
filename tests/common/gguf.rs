//! GGUF files written from tests/fixtures as llama.cpp's converter writes them (its tensor
//! names, F32 blocks, Llama's q/k rows permuted, the byte-level tokenizer as `gpt2`
//! metadata), with edits to their metadata: for the GGUF tests.

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use std::path::{Path, PathBuf};

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

pub fn llama_cpp_name(hf: &str) -> String {
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
pub fn permute(w: &Tensor, heads: usize) -> Tensor {
    let dims = w.dims().to_vec();
    let mut split = vec![heads, 2, dims[0] / heads / 2];
    split.extend_from_slice(&dims[1..]);
    let t = w.reshape(split).unwrap().transpose(1, 2).unwrap();
    t.contiguous().unwrap().reshape(dims).unwrap()
}

pub fn strings(items: impl IntoIterator<Item = String>) -> Value {
    Value::Array(items.into_iter().map(Value::String).collect())
}

/// The fixture's tokenizer.json as `tokenizer.ggml.*` metadata (byte-level BPE: `gpt2`).
pub fn tokenizer_metadata(dir: &Path, meta: &mut Vec<(String, Value)>) {
    let tok = super::reference(&dir.join("tokenizer.json"));
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
pub fn to_gguf(name: &str, file: &str, edit: impl Fn(&mut Vec<(String, Value)>)) -> PathBuf {
    let dir = super::fixture_dir(name);
    let cfg = super::reference(&dir.join("config.json"));
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

/// A change to a GGUF's metadata before it is written.
pub type Edit = Box<dyn Fn(&mut Vec<(String, Value)>)>;

pub fn without(key: &'static str) -> impl Fn(&mut Vec<(String, Value)>) {
    move |meta| meta.retain(|(k, _)| k != key)
}

pub fn set(key: &'static str, value: Value) -> impl Fn(&mut Vec<(String, Value)>) {
    move |meta| {
        meta.retain(|(k, _)| k != key);
        meta.push((key.into(), value.clone()));
    }
}

/// Where one tensor's entry of the table lies in the file.
pub struct Entry {
    pub name: String,
    pub dims_at: usize,
    pub n_dims: usize,
    pub type_at: usize,
    pub offset_at: usize,
}

pub fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

pub fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// Bytes of one GGUF value of type `ty` at `at` (a well-formed file: ours).
fn value_len(b: &[u8], at: usize, ty: u32) -> usize {
    match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        10..=12 => 8,
        8 => 8 + u64_at(b, at) as usize,
        9 => {
            let (item, n) = (u32_at(b, at), u64_at(b, at + 4) as usize);
            let mut len = 12;
            for _ in 0..n {
                len += value_len(b, at + len, item);
            }
            len
        }
        t => panic!("type {t}"),
    }
}

/// The tensor table of a GGUF file written by `to_gguf`.
pub fn table(b: &[u8]) -> Vec<Entry> {
    let (n_tensors, n_kv) = (u64_at(b, 8), u64_at(b, 16));
    let mut at = 24;
    for _ in 0..n_kv {
        at += 8 + u64_at(b, at) as usize;
        let ty = u32_at(b, at);
        at += 4 + value_len(b, at + 4, ty);
    }
    (0..n_tensors)
        .map(|_| {
            let len = u64_at(b, at) as usize;
            let name = String::from_utf8(b[at + 8..at + 8 + len].to_vec()).unwrap();
            at += 8 + len;
            let n_dims = u32_at(b, at) as usize;
            let e = Entry {
                name,
                n_dims,
                dims_at: at + 4,
                type_at: at + 4 + 8 * n_dims,
                offset_at: at + 8 + 8 * n_dims,
            };
            at = e.offset_at + 8;
            e
        })
        .collect()
}
