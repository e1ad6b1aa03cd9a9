//! config.json in two stages: [`HfConfig`] mirrors the file as the hub writes it (both RoPE key
//! layouts, optional fields), and [`HfConfig::validate`] resolves it into a [`ModelConfig`]
//! with no `Option`s, rejecting what the engine cannot run with a message naming the field.

pub mod deepseek;
mod gqa;
mod rope;

use crate::error::{Error, Result};
pub use deepseek::{MlaConfig, MoeConfig, Router};
pub use rope::{HfRope, RopeConfig, RopeScaling, YarnScaling};
use serde::Deserialize;
use std::path::Path;

/// `eos_token_id` is an int in older configs and a list in newer ones.
#[derive(Debug, Clone, Deserialize)]
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
    /// DeepSeek's multi-head latent attention and MoE (see [`deepseek`]).
    #[serde(flatten)]
    pub deepseek: deepseek::HfDeepseek,
}

fn default_eps() -> f64 {
    1e-6
}

/// The model families the engine loads; `model_type` selects one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    DeepseekV2,
    DeepseekV3,
}

impl Family {
    pub const ALL: [Family; 6] = [
        Family::Llama,
        Family::Mistral,
        Family::Qwen2,
        Family::Qwen3,
        Family::DeepseekV2,
        Family::DeepseekV3,
    ];

    /// The `model_type` of config.json.
    pub fn model_type(&self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::DeepseekV2 => "deepseek_v2",
            Family::DeepseekV3 => "deepseek_v3",
        }
    }
}

/// The two tensors one layer caches, each (heads, width) per token: K and V (`kv`), or MLA's
/// latent `c_kv` and shared `k_pe`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheLayout {
    pub a: (usize, usize),
    pub b: (usize, usize),
    pub kv: bool,
}

impl CacheLayout {
    /// Values per token: heads × width of both tensors.
    pub fn values(&self) -> usize {
        self.a.0 * self.a.1 + self.b.0 * self.b.1
    }
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

    pub fn family(&self) -> Result<Family> {
        Family::ALL
            .into_iter()
            .find(|f| f.model_type() == self.model_type)
            .ok_or_else(|| {
                let known: Vec<_> = Family::ALL.iter().map(|f| f.model_type()).collect();
                let msg = format!(
                    "unknown model_type {:?} (supported: {})",
                    self.model_type,
                    known.join(", ")
                );
                Error::Config(msg)
            })
    }

    /// Resolves every size and rejects what the engine cannot run.
    pub fn validate(&self) -> Result<ModelConfig> {
        let family = self.family()?;
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
        if self.rms_norm_eps.is_nan() || self.rms_norm_eps <= 0.0 {
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

impl ModelConfig {
    /// Reads config.json and validates it.
    pub fn from_file(path: &Path) -> Result<Self> {
        HfConfig::from_file(path)?.validate().map_err(|e| match e {
            Error::Config(msg) => Error::file(path, msg),
            other => other,
        })
    }

    /// The attention variant's short name: `mha`, `mqa`, `gqa` or `mla`.
    pub fn attention_kind(&self) -> &'static str {
        match &self.attention {
            AttentionConfig::Gqa { num_kv_heads, .. }
                if *num_kv_heads == self.num_attention_heads =>
            {
                "mha"
            }
            AttentionConfig::Gqa {
                num_kv_heads: 1, ..
            } => "mqa",
            AttentionConfig::Gqa { .. } => "gqa",
            AttentionConfig::Mla(_) => "mla",
        }
    }

    /// What one layer caches per token. `expanded` asks MLA for its up-projected per-head K
    /// and V instead of the latent (for comparisons); other layouts ignore it.
    pub fn cache_layout(&self, expanded: bool) -> CacheLayout {
        let h = self.num_attention_heads;
        match &self.attention {
            AttentionConfig::Gqa {
                num_kv_heads: g,
                head_dim: d,
                ..
            } => CacheLayout {
                a: (*g, *d),
                b: (*g, *d),
                kv: true,
            },
            AttentionConfig::Mla(m) if expanded => CacheLayout {
                a: (h, m.qk_nope_head_dim + m.qk_rope_head_dim),
                b: (h, m.v_head_dim),
                kv: true,
            },
            AttentionConfig::Mla(m) => CacheLayout {
                a: (1, m.kv_lora_rank),
                b: (1, m.qk_rope_head_dim),
                kv: false,
            },
        }
    }

    /// Values the cache stores per token per layer.
    pub fn kv_values_per_token_per_layer(&self) -> usize {
        self.cache_layout(false).values()
    }

    /// What MHA with the same heads would cache per token per layer (for comparison).
    pub fn mha_values_per_token_per_layer(&self) -> usize {
        match &self.attention {
            AttentionConfig::Gqa { head_dim, .. } => 2 * self.num_attention_heads * head_dim,
            AttentionConfig::Mla(_) => self.cache_layout(true).values(),
        }
    }

    /// KV-cache bytes per token over all layers at the given element size.
    pub fn kv_bytes_per_token(&self, dtype_size: usize) -> usize {
        self.num_hidden_layers * self.kv_values_per_token_per_layer() * dtype_size
    }
}
