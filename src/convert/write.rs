//! `convert`: a converted checkpoint written as a standard Hugging Face directory
//! (config.json, model.safetensors, the tokenizer and generation files) that loads back
//! here, and for MHA/GQA/MQA in transformers, with the same results. The tensors come from
//! [`Conversion::rewrite`], the door `--attention` loads through, so what is written is
//! what `--attention` runs. The directory is built beside DIR under a temporary name and
//! renamed into place at the end: a failure leaves nothing half-written.
//!
//! `lowrank:R` and `mla:R,rope=W` results have no standard class and are written in our
//! layout, which loads here only: low-rank K/V as config.json `kv_latent_rank` and per layer
//! `kv_down`, `k_up`, `v_up` in place of `k_proj`, `v_proj`; MLA as DeepSeek's fields and
//! tensors (`kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`;
//! `q_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`) in a Llama config, with two of ours:
//! `rope_groups` and `kv_latent_norm: false` (see `MlaConfig`).

use super::{Conversion, Report, Request, Stage};
use crate::config::{AttentionConfig, ModelConfig};
use crate::error::{Error, Result};
use crate::loader::Source;
use candle_core::{DType, Device};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Files that travel with the weights when the checkpoint has them.
const COPIED: [&str; 8] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
];

/// Where [`write`](fn@write) keeps the calibration text the original wrote for `--heal`.
pub const OWN_TEXT: &str = "heal_calibration.txt";

/// What [`write`](fn@write) wrote.
#[derive(Debug, Clone)]
pub struct Written {
    pub report: Report,
    pub tensors: usize,
    /// Bytes of tensor data in model.safetensors.
    pub bytes: usize,
    /// The files of the directory, config.json and model.safetensors first.
    pub files: Vec<String>,
}

/// Converts `source` as `req` asks and writes it to `out`, every tensor in its checkpoint
/// dtype (`dtype`: all in that one instead), calibrating and healing on `device`. `out` must
/// not exist or be empty.
pub fn write(
    source: &Source,
    req: &Request,
    dtype: Option<DType>,
    out: &Path,
    device: &Device,
    mut progress: impl FnMut(Stage, usize, usize),
) -> Result<Written> {
    check_out(out)?;
    // Before anything slow: a GGUF file or a broken checkpoint is refused here.
    let stored = source.stored()?;
    let partial = Partial::create(out)?;
    let conversion = Conversion::prepare(source, &stored, req, device, &mut progress)?;
    let (cfg, backend) = conversion.rewrite(&stored.cfg, stored.backend)?;
    let mut tensors = Vec::with_capacity(stored.tensors.len());
    let mut bytes = 0;
    for (i, info) in stored.tensors.iter().enumerate() {
        let want = match dtype.or(info.float_dtype()) {
            Some(d) => d,
            None => {
                return Err(Error::Invalid(format!(
                    "{}: dtype {} is not one convert writes (F32, F16, BF16)",
                    info.name, info.dtype
                )))
            }
        };
        for name in written_as(&conversion, &info.name) {
            let t = backend
                .get_unchecked(&name, want, &Device::Cpu)?
                .contiguous()?;
            bytes += t.elem_count() * want.size_in_bytes();
            tensors.push((name, t));
        }
        progress(Stage::Converting, i + 1, stored.tensors.len());
    }
    let dir = &partial.path;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let refs = tensors.iter().map(|(n, t)| (n.as_str(), t));
    let weights = dir.join("model.safetensors");
    safetensors::serialize_to_file(refs, Some(metadata), &weights)
        .map_err(|e| Error::file(&weights, e))?;
    let config = config_json(&stored.config, &cfg, dtype)?;
    let config_path = dir.join("config.json");
    write_file(&config_path, config.as_bytes())?;
    // safetensors creates its file owner-only (0600); give it the umask's mode, as config.json.
    let mode = std::fs::metadata(&config_path).map_err(|e| Error::file(&config_path, e))?;
    std::fs::set_permissions(&weights, mode.permissions()).map_err(|e| Error::file(&weights, e))?;
    let mut files = vec!["config.json".to_string(), "model.safetensors".to_string()];
    files.extend(copy_companions(source, dir)?);
    // The text the original wrote to heal on, kept: `--calibration` reads it back, for a
    // second conversion without writing it again.
    if let Some(text) = conversion.own_text() {
        write_file(&dir.join(OWN_TEXT), text.as_bytes())?;
        files.push(OWN_TEXT.to_string());
    }
    partial.finish(out)?;
    Ok(Written {
        report: conversion.report(),
        tensors: tensors.len(),
        bytes,
        files,
    })
}

/// The tensors a checkpoint tensor becomes in the converted one: itself, except that a
/// low-rank conversion replaces each layer's `k_proj` and `v_proj` by `kv_down` (with the
/// keys' bias, if any), `k_up` and `v_up`, and MLA every projection but `o_proj` by the
/// conversion's tensors (written where `q_proj.weight` was), in the dtype of the
/// projections they replace; `o_proj.weight` stays where it was (healing may change it).
fn written_as(conversion: &Conversion, name: &str) -> Vec<String> {
    let Some(latent) = conversion.plan().latent else {
        return vec![name.to_string()];
    };
    let Some((layer, tail)) = name.split_once(".self_attn.") else {
        return vec![name.to_string()];
    };
    let new = |p: &str| format!("{layer}.self_attn.{p}");
    if latent.rope.is_some() {
        return match tail {
            // `o_proj.weight` (healed, or as it was) is written in its own place.
            "q_proj.weight" => (conversion.replaced_names(&new("")).into_iter())
                .filter(|n| *n != new("o_proj.weight"))
                .collect(),
            t if t.starts_with("o_proj.") => vec![name.to_string()],
            _ => vec![],
        };
    }
    match tail {
        "k_proj.weight" => vec![new("kv_down.weight"), new("k_up.weight")],
        "k_proj.bias" => vec![new("kv_down.bias")],
        "v_proj.weight" => vec![new("v_up.weight")],
        "v_proj.bias" => vec![],
        _ => vec![name.to_string()],
    }
}

/// `out` must be free: absent, or an empty directory.
fn check_out(out: &Path) -> Result<()> {
    let taken = match std::fs::read_dir(out) {
        Ok(mut entries) => entries.next().is_some(),
        Err(_) => out.exists(),
    };
    match taken {
        true => Err(Error::file(
            out,
            "already exists and is not an empty directory: choose a new --out",
        )),
        false => Ok(()),
    }
}

/// The original config.json with the converted K/V heads, a top-level `rope_theta` beside
/// `rope_parameters` (older readers look only there), and the dtype written when `--dtype`
/// changed it. Everything else, architecture and model_type included, is kept.
fn config_json(original: &Value, cfg: &ModelConfig, dtype: Option<DType>) -> Result<String> {
    let mut v = original.clone();
    let obj = v
        .as_object_mut()
        .ok_or_else(|| Error::Config("not a JSON object".into()))?;
    if let AttentionConfig::Gqa {
        num_kv_heads,
        kv_latent_rank,
        ..
    } = cfg.attention
    {
        obj.insert("num_key_value_heads".into(), json!(num_kv_heads));
        if let Some(r) = kv_latent_rank {
            obj.insert("kv_latent_rank".into(), json!(r));
        }
    }
    if let AttentionConfig::Mla(m) = &cfg.attention {
        if m.latent_norm {
            deepseek_fields(obj, cfg);
        }
        let fields = [
            ("q_lora_rank", json!(Some(m.q_lora_rank).filter(|&r| r > 0))),
            ("kv_lora_rank", json!(m.kv_lora_rank)),
            ("qk_nope_head_dim", json!(m.qk_nope_head_dim)),
            ("qk_rope_head_dim", json!(m.qk_rope_head_dim)),
            ("v_head_dim", json!(m.v_head_dim)),
            ("rope_interleave", json!(cfg.rope.interleaved)),
        ];
        for (k, v) in fields {
            obj.insert(k.into(), v);
        }
        if !m.latent_norm {
            obj.insert("rope_groups".into(), json!(m.rope_groups));
            obj.insert("kv_latent_norm".into(), json!(false));
        }
    }
    obj.insert("rope_theta".into(), json!(cfg.rope.theta));
    if let Some(d) = dtype {
        let torch = match d {
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
            _ => "float32",
        };
        for key in ["dtype", "torch_dtype"] {
            if obj.contains_key(key) {
                obj.insert(key.into(), json!(torch));
            }
        }
    }
    serde_json::to_string_pretty(&v).map_err(|e| Error::Config(e.to_string()))
}

/// A Llama/Qwen2 config made DeepSeek-V3's (`layout=deepseek`): its class, every layer
/// dense (`first_k_dense_replace` = the layers, so no expert is built), the attention
/// biases that hold the anchors (`convert::deepseek`), and no key DeepSeek does not have
/// for attention (sliding windows, head_dim, K/V heads other than the query heads).
fn deepseek_fields(obj: &mut serde_json::Map<String, Value>, cfg: &ModelConfig) {
    for key in [
        "head_dim",
        "sliding_window",
        "use_sliding_window",
        "max_window_layers",
        "layer_types",
        "mlp_bias",
    ] {
        obj.remove(key);
    }
    let fields = [
        ("architectures", json!(["DeepseekV3ForCausalLM"])),
        ("model_type", json!("deepseek_v3")),
        ("num_key_value_heads", json!(cfg.num_attention_heads)),
        ("first_k_dense_replace", json!(cfg.num_hidden_layers)),
        ("attention_bias", json!(true)),
    ];
    for (k, v) in fields {
        obj.insert(k.into(), v);
    }
}

/// Copies the tokenizer and generation files beside the weights (a bundled model's
/// tokenizer.json is written from the binary); returns their names.
fn copy_companions(source: &Source, dir: &Path) -> Result<Vec<String>> {
    let mut copied = Vec::new();
    match source {
        Source::Files(files) => {
            let from = files.config.parent().unwrap_or(Path::new("."));
            for name in COPIED {
                let path = from.join(name);
                if path.is_file() {
                    std::fs::copy(&path, dir.join(name)).map_err(|e| Error::file(&path, e))?;
                    copied.push(name.to_string());
                }
            }
        }
        Source::Bundled(b) => {
            write_file(&dir.join("tokenizer.json"), b.tokenizer)?;
            copied.push("tokenizer.json".to_string());
        }
        Source::Gguf(_) => {}
    }
    Ok(copied)
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(|e| Error::file(path, e))
}

/// The directory being written, `.NAME.partial-PID` beside the final one; removed on drop
/// unless [`Partial::finish`] renamed it into place.
struct Partial {
    path: PathBuf,
    done: bool,
}

impl Partial {
    fn create(out: &Path) -> Result<Self> {
        let name = out
            .file_name()
            .ok_or_else(|| Error::file(out, "--out needs a directory name"))?;
        let parent = out.parent().filter(|p| !p.as_os_str().is_empty());
        let parent = parent.unwrap_or(Path::new("."));
        std::fs::create_dir_all(parent)
            .map_err(|e| Error::file(parent, format!("cannot make --out's parent: {e}")))?;
        let tmp = format!(".{}.partial-{}", name.to_string_lossy(), std::process::id());
        let path = parent.join(tmp);
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir(&path)
            .map_err(|e| Error::file(out, format!("cannot write beside it: {e}")))?;
        Ok(Self { path, done: false })
    }

    /// Renames the finished directory to `out` (which may be an empty directory).
    fn finish(mut self, out: &Path) -> Result<()> {
        std::fs::rename(&self.path, out).map_err(|e| Error::file(out, e))?;
        self.done = true;
        Ok(())
    }
}

impl Drop for Partial {
    fn drop(&mut self) {
        if !self.done {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}
