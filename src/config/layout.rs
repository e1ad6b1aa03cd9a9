//! What a validated config implies in sizes: what one layer caches per token
//! ([`CacheLayout`]), the attention variant's name, and the bytes a KV cache or a set of
//! weights would take, checked against the memory this machine has before anything is
//! allocated (a config with absurd sizes is an error naming the field, not an abort).

use super::{AttentionConfig, MlpConfig, ModelConfig};
use crate::error::{Error, Result};

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

impl ModelConfig {
    /// The attention variant's short name: `mha`, `mqa`, `gqa`, `lowrank` or `mla`.
    pub fn attention_kind(&self) -> &'static str {
        match &self.attention {
            AttentionConfig::Gqa {
                num_kv_heads,
                kv_latent_rank: None,
                ..
            } if *num_kv_heads == self.num_attention_heads => "mha",
            AttentionConfig::Gqa {
                kv_latent_rank: Some(_),
                ..
            } => "lowrank",
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
            // The latent alone: MLA's layout with no shared RoPE key.
            AttentionConfig::Gqa {
                kv_latent_rank: Some(r),
                ..
            } => CacheLayout {
                a: (1, *r),
                b: (1, 0),
                kv: false,
            },
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

    /// What `budget` bytes of KV cache hold at the given element size: tokens of context,
    /// and whole sequences of `seq_len` tokens.
    pub fn kv_capacity(&self, dtype_size: usize, budget: usize, seq_len: usize) -> (usize, usize) {
        let tokens = budget / self.kv_bytes_per_token(dtype_size).max(1);
        (tokens, tokens / seq_len.max(1))
    }

    /// Parameters a checkpoint of this config holds (embeddings, attention, MLPs and LM
    /// head; norms are too small to count): the size random weights would take, estimated
    /// before allocating them. Computed in u128 and saturated, so no size can overflow it.
    pub fn parameter_estimate(&self) -> usize {
        let (h, heads) = (self.hidden_size as u128, self.num_attention_heads as u128);
        let attn = match &self.attention {
            AttentionConfig::Gqa {
                num_kv_heads: g,
                head_dim: d,
                kv_latent_rank,
                ..
            } => {
                let (d, g) = (*d as u128, *g as u128);
                let kv = match kv_latent_rank {
                    Some(r) => *r as u128 * (h + 2 * g * d),
                    None => h * 2 * g * d,
                };
                h * d * 2 * heads + kv
            }
            AttentionConfig::Mla(m) => {
                let [r_q, r_kv, nope, rope, v] = [
                    m.q_lora_rank,
                    m.kv_lora_rank,
                    m.qk_nope_head_dim,
                    m.qk_rope_head_dim,
                    m.v_head_dim,
                ]
                .map(|x| x as u128);
                let q = match r_q {
                    0 => h * heads * (nope + rope),
                    r => h * r + r * heads * (nope + rope),
                };
                q + h * (r_kv + rope) + r_kv * heads * (nope + v) + heads * v * h
            }
        };
        let mlp: u128 = self
            .mlp
            .iter()
            .map(|m| match m {
                MlpConfig::Dense {
                    intermediate_size, ..
                } => 3 * h * *intermediate_size as u128,
                MlpConfig::Moe(moe) => {
                    let experts = (moe.n_routed_experts + moe.n_shared_experts) as u128;
                    let inter = moe.moe_intermediate_size as u128;
                    3 * h * inter * experts + h * moe.n_routed_experts as u128
                }
            })
            .sum();
        let heads_and_embedding = match self.tie_word_embeddings {
            true => 1,
            false => 2,
        };
        let total = heads_and_embedding * self.vocab_size as u128 * h
            + self.num_hidden_layers as u128 * attn
            + mlp;
        usize::try_from(total).unwrap_or(usize::MAX)
    }
}

/// Refuses an allocation of `bytes` that this machine cannot hold (more than its memory and
/// swap together), naming what it is for and what sets its size, so an absurd size is an
/// error instead of an abort inside the allocator.
pub fn check_fits(bytes: usize, what: &str, fix: &str) -> Result<()> {
    match total_memory_bytes() {
        Some(total) if bytes > total => Err(Error::Invalid(format!(
            "{what} would need {:.1} GB but this machine has {:.1} GB of memory: {fix}",
            bytes as f64 / 1e9,
            total as f64 / 1e9
        ))),
        _ => Ok(()),
    }
}

/// Memory plus swap (Linux `/proc/meminfo`); `None` where unknown, and then nothing is
/// refused up front.
fn total_memory_bytes() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb = |key: &str| -> Option<usize> {
        let line = info.lines().find(|l| l.starts_with(key))?;
        line.split_whitespace().nth(1)?.parse().ok()
    };
    Some((kb("MemTotal:")? + kb("SwapTotal:").unwrap_or(0)) * 1024)
}
