//! config.json in two stages: [`HfConfig`] mirrors the file as the hub writes it (both RoPE key
//! layouts, optional fields), and [`HfConfig::validate`] resolves it into a [`ModelConfig`]
//! with no `Option`s, rejecting what the engine cannot run with a message naming the field.

pub mod deepseek;
mod family;
mod generation;
mod gqa;
mod layout;
mod rope;

use crate::error::{Error, Result};
use candle_core::DType;
pub use deepseek::{MlaConfig, MoeConfig, Router};
pub use family::Family;
pub use generation::GenerationConfig;
pub use layout::{check_fits, CacheLayout};
pub use rope::{HfRope, RopeConfig, RopeScaling, YarnScaling};
use serde::Deserialize;
use std::path::Path;

/// `eos_token_id` is an int in older configs and a list in newer ones.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(id) => vec![*id],
            TokenIds::Many(ids) => ids.clone(),
        }
    }
}

/// config.json exactly as found on the hub.
#[derive(Debug, Clone, Deserialize)]
pub struct HfConfig {
    pub model_type: String,
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    pub num_key_value_heads: Option<i64>,
    pub head_dim: Option<i64>,
    /// Ours, written by `convert --attention lowrank:R`: K and V come from one rank-R latent
    /// of the attention input, which is what the cache holds (see [`AttentionConfig::Gqa`]).
    pub kv_latent_rank: Option<i64>,
    pub max_position_embeddings: i64,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    pub eos_token_id: Option<TokenIds>,
    pub bos_token_id: Option<u32>,
    pub rope_theta: Option<f64>,
    pub rope_scaling: Option<HfRope>,
    pub rope_parameters: Option<HfRope>,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    pub sliding_window: Option<i64>,
    #[serde(default)]
    pub use_sliding_window: bool,
    /// The checkpoint's dtype: `torch_dtype` until transformers 5, `dtype` since.
    pub torch_dtype: Option<String>,
    pub dtype: Option<String>,
    /// Present in GPTQ, AWQ, bitsandbytes and FP8 checkpoints, which are refused.
    pub quantization_config: Option<serde_json::Value>,
    /// DeepSeek's multi-head latent attention and MoE (see [`deepseek`]).
    #[serde(flatten)]
    pub deepseek: deepseek::HfDeepseek,
}

fn default_eps() -> f64 {
    1e-6
}

/// How the attention layer is built and what the cache holds per token.
#[derive(Debug, Clone, PartialEq)]
pub enum AttentionConfig {
    /// MHA (`num_kv_heads == num_heads`), GQA, or MQA (`num_kv_heads == 1`).
    Gqa {
        num_kv_heads: usize,
        head_dim: usize,
        /// Bias on q/k/v projections (Qwen2, Llama `attention_bias`).
        qkv_bias: bool,
        /// Bias on o_proj (Llama `attention_bias` only).
        o_bias: bool,
        /// Per-head RMSNorm of q and k before RoPE (Qwen3).
        qk_norm: bool,
        /// Low-rank K/V (ours, config.json `kv_latent_rank`, from `--attention lowrank:R`):
        /// `k_proj`/`v_proj` are replaced by `kv_down` (C → R, with the q/k/v bias) and
        /// `k_up`, `v_up` (R → G·D); the cache holds the R-wide latent, and the keys are
        /// rebuilt and rotated from it at every step (Palu's layout: not absorbable, RoPE
        /// stays on every key dimension).
        kv_latent_rank: Option<usize>,
    },
    /// DeepSeek's multi-head latent attention.
    Mla(deepseek::MlaConfig),
}

/// The MLP of one layer: dense SwiGLU, or DeepSeek's mixture of experts.
#[derive(Debug, Clone, PartialEq)]
pub enum MlpConfig {
    Dense {
        intermediate_size: usize,
        bias: bool,
    },
    Moe(deepseek::MoeConfig),
}

/// A validated model description: every size resolved, nothing optional.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub family: Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// Context length: the cache never grows past it.
    pub max_position_embeddings: usize,
    /// Keys further back than this are masked; `>= max_position_embeddings` means no window.
    pub sliding_window: usize,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
    pub eos_token_ids: Vec<u32>,
    pub attention: AttentionConfig,
    pub rope: RopeConfig,
    /// One entry per layer (DeepSeek's first layers are dense, the rest MoE).
    pub mlp: Vec<MlpConfig>,
}

/// Larger than any real model's size field; keeps products of sizes far from overflow.
const MAX_SIZE: i64 = 1 << 24;

/// A size field that must be a positive integer.
pub(crate) fn positive(field: &str, value: i64) -> Result<usize> {
    if value <= 0 || value > MAX_SIZE {
        let msg = format!("{field} must be between 1 and {MAX_SIZE}, got {value}");
        return Err(Error::Config(msg));
    }
    Ok(value as usize)
}

/// More layers than any real model has; bounds the per-layer tables built from the config.
const MAX_LAYERS: i64 = 4096;

/// `num_hidden_layers`, checked.
pub(crate) fn num_layers(hf: &HfConfig) -> Result<usize> {
    if hf.num_hidden_layers > MAX_LAYERS {
        return Err(Error::Config(format!(
            "num_hidden_layers must be at most {MAX_LAYERS}, got {}",
            hf.num_hidden_layers
        )));
    }
    positive("num_hidden_layers", hf.num_hidden_layers)
}

impl HfConfig {
    /// Reads and parses config.json; a parse error names the file, line and field.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::file(path, e))?;
        serde_json::from_str(&text)
            .map_err(|e| Error::file(path, format!("not a valid config: {e}")))
    }

    /// Resolves every size and rejects what the engine cannot run.
    pub fn validate(&self) -> Result<ModelConfig> {
        self.refuse_quantized()?;
        let family = Family::of(&self.model_type)?;
        let hidden_size = positive("hidden_size", self.hidden_size)?;
        let num_attention_heads = positive("num_attention_heads", self.num_attention_heads)?;
        let max_position_embeddings =
            positive("max_position_embeddings", self.max_position_embeddings)?;
        match self.hidden_act.as_deref() {
            None | Some("silu") | Some("swish") => {}
            Some(other) => {
                return Err(Error::Config(format!(
                    "hidden_act {other:?} is not supported (silu)"
                )))
            }
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(Error::Config(format!(
                "rms_norm_eps must be positive, got {}",
                self.rms_norm_eps
            )));
        }
        let (attention, rope, mlp) = match family {
            Family::DeepseekV2 | Family::DeepseekV3 => deepseek::resolve(self, family)?,
            _ => gqa::resolve(self, family)?,
        };
        Ok(ModelConfig {
            family,
            vocab_size: positive("vocab_size", self.vocab_size)?,
            hidden_size,
            num_hidden_layers: num_layers(self)?,
            num_attention_heads,
            max_position_embeddings,
            sliding_window: gqa::sliding_window(self, family, max_position_embeddings)?,
            rms_norm_eps: self.rms_norm_eps,
            tie_word_embeddings: self.tie_word_embeddings,
            eos_token_ids: self
                .eos_token_id
                .as_ref()
                .map(TokenIds::to_vec)
                .unwrap_or_default(),
            attention,
            rope,
            mlp,
        })
    }
}

impl HfConfig {
    /// The dtype config.json declares (`dtype`, else `torch_dtype`), if it names one the
    /// engine runs; an unknown name is an error naming the field.
    pub fn declared_dtype(&self) -> Result<Option<DType>> {
        let (field, name) = match (&self.dtype, &self.torch_dtype) {
            (Some(d), _) => ("dtype", d),
            (None, Some(d)) => ("torch_dtype", d),
            (None, None) => return Ok(None),
        };
        match name.trim_start_matches("torch.") {
            "float32" => Ok(Some(DType::F32)),
            "bfloat16" => Ok(Some(DType::BF16)),
            "float16" => Ok(Some(DType::F16)),
            other => Err(Error::Config(format!(
                "{field} {other:?} is not a dtype this engine runs (float32, bfloat16, float16)"
            ))),
        }
    }

    /// A quantized checkpoint's weights are packed integers or 8-bit floats that would be
    /// read as garbage: refuse it by its `quantization_config`, naming the method.
    fn refuse_quantized(&self) -> Result<()> {
        let Some(q) = &self.quantization_config else {
            return Ok(());
        };
        let method = q
            .get("quant_method")
            .and_then(|m| m.as_str())
            .unwrap_or("unknown");
        let bits = q.get("bits").and_then(|b| b.as_u64());
        let what = match (method, bits) {
            (_, Some(bits)) => format!("{method} ({bits}-bit)"),
            _ => method.to_string(),
        };
        Err(Error::Config(format!(
            "quantization_config: this is a {what} quantized checkpoint, which this engine \
             does not run: use the unquantized (bf16/f16/f32) checkpoint it was made from"
        )))
    }
}

impl ModelConfig {
    /// Reads config.json and validates it.
    pub fn from_file(path: &Path) -> Result<Self> {
        HfConfig::from_file(path)?.validate().map_err(|e| match e {
            Error::Config(msg) => Error::file(path, msg),
            other => other,
        })
    }
}
