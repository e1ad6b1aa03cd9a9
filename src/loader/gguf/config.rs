//! The model's config from GGUF metadata. llama.cpp's keys (`llama.block_count`, ...) are
//! written as the config.json transformers rebuilds from them (`integrations/ggml.py`:
//! `GGUF_CONFIG_MAPPING`, `load_gguf_checkpoint`) and handed to [`HfConfig`], so validation
//! stays in one place ([`crate::config`]).

use super::metadata::Meta;
use crate::config::HfConfig;
use crate::error::{Error, Result};
use candle_core::quantized::gguf_file::TensorInfo;
use serde_json::{json, Value};
use std::collections::HashMap;

/// The `general.architecture`s this engine loads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
}

impl Arch {
    /// The architecture the file names; anything else is an error naming it.
    pub(super) fn of(meta: &Meta) -> Result<Self> {
        match meta.str("general.architecture")? {
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            other => Err(meta.error(
                "general.architecture",
                format!("is {other:?}, which this engine does not load (llama, qwen2)"),
            )),
        }
    }

    /// The name its metadata keys start with, and config.json's `model_type`.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
        }
    }
}

/// The config.json transformers would write for this file, parsed.
pub(super) fn hf_config(
    meta: &Meta,
    arch: Arch,
    tensors: &HashMap<String, TensorInfo>,
) -> Result<HfConfig> {
    let a = arch.name();
    let key = |k: &str| format!("{a}.{k}");
    let heads = meta.int(&key("attention.head_count"))?;
    // transformers reads `{arch}.vocab_size`, else counts the tokens.
    let vocab_size = match meta.opt_int(&key("vocab_size"))? {
        Some(n) => n,
        None => match meta.opt_strings("tokenizer.ggml.tokens")? {
            Some(tokens) => tokens.len() as i64,
            None => {
                return Err(meta.error(
                    &key("vocab_size"),
                    "is missing (and so is tokenizer.ggml.tokens)",
                ))
            }
        },
    };
    // Llama's head width is stated as its rotary width; `key_length` says it directly.
    let head_dim = match (meta.opt_int(&key("attention.key_length"))?, arch) {
        (Some(d), _) => Some(d),
        (None, Arch::Llama) => meta.opt_int(&key("rope.dimension_count"))?,
        (None, Arch::Qwen2) => None,
    };
    let mut config = json!({
        "model_type": a,
        "vocab_size": vocab_size,
        "hidden_size": meta.int(&key("embedding_length"))?,
        "intermediate_size": meta.int(&key("feed_forward_length"))?,
        "num_hidden_layers": meta.int(&key("block_count"))?,
        "num_attention_heads": heads,
        "num_key_value_heads": meta.opt_int(&key("attention.head_count_kv"))?.unwrap_or(heads),
        "head_dim": head_dim,
        "max_position_embeddings": meta.int(&key("context_length"))?,
        "rms_norm_eps": meta.float(&key("attention.layer_norm_rms_epsilon"))?,
        // llama.cpp's default when the key is absent.
        "rope_theta": meta.opt_float(&key("rope.freq_base"))?.unwrap_or(10_000.0),
        "rope_scaling": rope_scaling(meta, a, tensors)?,
        "hidden_act": "silu",
        // llama.cpp writes the output projection only when it is not the embedding matrix.
        "tie_word_embeddings": !tensors.contains_key("output.weight"),
        // Qwen2 always has q/k/v biases; a Llama file has them only if it says so by tensor.
        "attention_bias": arch == Arch::Llama && tensors.contains_key("blk.0.attn_q.bias"),
        "bos_token_id": meta.opt_index("tokenizer.ggml.bos_token_id")?,
        "eos_token_id": stop_ids(meta)?,
    });
    if let Some(map) = config.as_object_mut() {
        map.retain(|_, v| !v.is_null());
    }
    serde_json::from_value(config).map_err(|e| {
        Error::file(
            meta.path,
            format!("metadata does not make a valid config: {e}"),
        )
    })
}

/// The ids that end generation: the EOS token, and the end-of-turn token where the file names
/// a different one (llama.cpp stops at both).
fn stop_ids(meta: &Meta) -> Result<Value> {
    let eos = meta.opt_index("tokenizer.ggml.eos_token_id")?;
    let eot = meta.opt_index("tokenizer.ggml.eot_token_id")?;
    Ok(match (eos, eot) {
        (Some(eos), Some(eot)) if eos != eot => json!([eos, eot]),
        (Some(id), _) | (None, Some(id)) => json!(id),
        (None, None) => Value::Null,
    })
}

/// `{arch}.rope.scaling.*` as config.json's `rope_scaling`: none and linear are read; other
/// kinds, and Llama 3's per-frequency factors (the `rope_freqs.weight` tensor, whose
/// parameters the metadata does not state), are refused by name rather than run wrong.
fn rope_scaling(meta: &Meta, a: &str, tensors: &HashMap<String, TensorInfo>) -> Result<Value> {
    if tensors.contains_key("rope_freqs.weight") {
        return Err(Error::file(
            meta.path,
            "tensor rope_freqs.weight (Llama 3.1+ RoPE frequency factors) is not supported yet",
        ));
    }
    let kind_key = format!("{a}.rope.scaling.type");
    match meta.opt_str(&kind_key)? {
        None | Some("none") => Ok(Value::Null),
        Some("linear") => {
            let factor = meta.float(&format!("{a}.rope.scaling.factor"))?;
            Ok(json!({"rope_type": "linear", "factor": factor}))
        }
        Some(other) => Err(meta.error(
            &kind_key,
            format!("is {other:?}, a RoPE scaling this loader does not read yet (none, linear)"),
        )),
    }
}
