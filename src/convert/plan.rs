//! The [`Plan`] a [`Spec`] becomes for one checkpoint: the K/V heads, latent and method to
//! build, or a one-line error that says what would work when it cannot apply.

use super::spec::{bad, Layout, Method, MlaLayout, Spec};
use mla::{mla_fits, mla_layout};

mod mla;
use crate::config::{AttentionConfig, MlaConfig, ModelConfig};
use crate::error::Result;

/// A spec checked against one model: the K/V heads to build and the method that makes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    pub spec: Spec,
    pub num_heads: usize,
    /// K/V heads of the checkpoint, and of the converted model.
    pub from_kv_heads: usize,
    pub to_kv_heads: usize,
    pub method: Method,
    /// `lowrank:R`: the latent's rank, and the full rank of the keys and values (2·G·D),
    /// where the conversion is exact.
    pub latent: Option<Latent>,
}

/// The rank of a `lowrank:R` or `mla:R,rope=W` conversion and the full rank it cuts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Latent {
    pub rank: usize,
    pub full: usize,
    /// MLA's RoPE key width W: `to_kv_heads` = W / head_dim heads of it, merged from the
    /// original K/V heads as `gqa:W/D` merges them. `None` for `lowrank`.
    pub rope: Option<usize>,
    /// MLA's layout, resolved (see [`MlaLayout`]); `Ours` for `lowrank`, which has no other.
    pub layout: MlaLayout,
}

impl Latent {
    /// The rank fitted to the keys and values: `rank`, less the anchor channel that
    /// DeepSeek's layout keeps in the latent (`convert::deepseek`).
    pub fn fitted(&self) -> usize {
        self.rank - (self.layout == MlaLayout::Deepseek) as usize
    }
}

impl Spec {
    /// Whether this spec asks for (or defaults to) DeepSeek's MLA layout on heads of `d`
    /// dims, whose latent holds one anchor channel beside the fitted rank.
    fn anchored(&self, d: usize) -> bool {
        match self.layout {
            Layout::Mla { rope, layout, .. } => {
                layout.unwrap_or(match rope == d {
                    true => MlaLayout::Deepseek,
                    false => MlaLayout::Ours,
                }) == MlaLayout::Deepseek
            }
            _ => false,
        }
    }

    /// Checks the spec against `cfg` and resolves the K/V heads and the method.
    pub fn plan(&self, cfg: &ModelConfig) -> Result<Plan> {
        let AttentionConfig::Gqa {
            num_kv_heads,
            head_dim,
            qk_norm,
            kv_latent_rank,
            qkv_bias,
            o_bias,
        } = cfg.attention
        else {
            return Err(bad(format!(
                "{self}: this checkpoint has MLA attention, which does not convert yet; \
                 --attention applies to MHA/GQA/MQA checkpoints"
            )));
        };
        if let Some(r) = kv_latent_rank {
            return Err(bad(format!(
                "{self}: this checkpoint already has low-rank K/V (kv_latent_rank {r}); \
                 convert the original checkpoint instead"
            )));
        }
        let h = cfg.num_attention_heads;
        let full = 2 * num_kv_heads * head_dim;
        let latent = match self.layout {
            Layout::LowRank { rank } | Layout::Mla { rank, .. }
                if rank > full + self.anchored(head_dim) as usize =>
            {
                let most = full + self.anchored(head_dim) as usize;
                return Err(bad(format!(
                    "{self}: rank {rank} is above the full rank of this model's keys and \
                     values (2 × {num_kv_heads} K/V heads × head_dim {head_dim} = {full}{}); \
                     use a rank of at most {most}",
                    if most > full {
                        ", and DeepSeek's layout's anchor"
                    } else {
                        ""
                    }
                )));
            }
            Layout::LowRank { rank } => Some(Latent {
                rank,
                full,
                rope: None,
                layout: MlaLayout::Ours,
            }),
            Layout::Mla { rank, rope, layout } => {
                mla_fits(self, cfg, num_kv_heads, head_dim, rope)?;
                let layout = mla_layout(self, cfg, layout, head_dim, rope, qkv_bias || o_bias)?;
                if layout == MlaLayout::Deepseek && rank < 2 {
                    return Err(bad(format!(
                        "{self}: DeepSeek's layout keeps an anchor channel in the latent, so \
                         the rank must be at least 2"
                    )));
                }
                if qk_norm {
                    return Err(bad(format!(
                        "{self}: MLA cannot hold per-head q/k norms (qwen3): a key normalised \
                         per head is no linear map of a latent shared by all heads, and \
                         DeepSeek's one latent norm spans every head; use lowrank:R or gqa:G"
                    )));
                }
                Some(Latent {
                    rank,
                    full,
                    rope: Some(rope),
                    layout,
                })
            }
            _ => None,
        };
        let to = match self.layout {
            Layout::Mha => h,
            Layout::Mqa => 1,
            Layout::Gqa(g) if g > h => {
                return Err(bad(format!(
                    "{self}: G ({g}) is more than the {h} query heads; at most gqa:{h} (mha)"
                )))
            }
            Layout::Gqa(g) if !h.is_multiple_of(g) => {
                let fits: Vec<String> = (1..=h)
                    .filter(|&d| h.is_multiple_of(d))
                    .map(|d| d.to_string())
                    .collect();
                let fits = fits.join(", ");
                return Err(bad(format!(
                    "{self}: G ({g}) does not divide the {h} query heads; use one of {fits}"
                )));
            }
            Layout::Gqa(g) => g,
            Layout::LowRank { .. } => num_kv_heads,
            Layout::Mla { rope, .. } => rope / head_dim,
        };
        let lossy = to < num_kv_heads || latent.is_some_and(|l| l.fitted() < l.full);
        // What stands in for `aware` where it cannot apply.
        let fallback = match latent {
            Some(_) => Method::Svd,
            None => Method::Mean,
        };
        let method = match self.method {
            None | Some(Method::Aware) if qk_norm && lossy => {
                if self.method.is_some() {
                    return Err(bad(format!(
                        "{self}: method=aware does not handle per-head q/k norms (qwen3); \
                         use method={}",
                        fallback.name()
                    )));
                }
                fallback
            }
            None => Method::Aware,
            Some(Method::Mean) if latent.is_some() => {
                return Err(bad(format!(
                    "{self}: method=mean applies to mha, mqa and gqa:G; use svd or aware"
                )))
            }
            Some(Method::Svd) if latent.is_none() => {
                return Err(bad(format!(
                    "{self}: method=svd applies to mla and lowrank; use mean or aware"
                )))
            }
            Some(m) => m,
        };
        Ok(Plan {
            spec: *self,
            num_heads: h,
            from_kv_heads: num_kv_heads,
            to_kv_heads: to,
            method,
            latent,
        })
    }
}

impl Plan {
    /// The config of the converted model: the same with `to_kv_heads` K/V heads, a latent
    /// of K/V, or MLA (see `convert::mla`).
    pub fn config(&self, cfg: &ModelConfig) -> ModelConfig {
        let mut out = cfg.clone();
        if let (Some(l), Some(rope)) = (self.latent, self.latent.and_then(|l| l.rope)) {
            let d = l.full / (2 * self.from_kv_heads);
            let q_bias = matches!(cfg.attention, AttentionConfig::Gqa { qkv_bias: true, .. });
            let deepseek = l.layout == MlaLayout::Deepseek;
            out.attention = AttentionConfig::Mla(MlaConfig {
                // DeepSeek's layout: an anchor channel beside the query and the latent
                // (`convert::deepseek`), the query through q-LoRA only for a query bias.
                q_lora_rank: match deepseek && q_bias {
                    true => cfg.hidden_size + 1,
                    false => 0,
                },
                kv_lora_rank: l.rank,
                qk_nope_head_dim: d,
                qk_rope_head_dim: rope,
                v_head_dim: d,
                // DeepSeek's scale, so that the config reads back as written; the
                // original's 1/√D is folded into the query (`convert::mla`).
                softmax_scale: 1.0 / ((d + rope) as f64).sqrt(),
                bias: deepseek,
                rope_groups: self.to_kv_heads,
                latent_norm: deepseek,
            });
            return out;
        }
        if let AttentionConfig::Gqa {
            num_kv_heads,
            kv_latent_rank,
            ..
        } = &mut out.attention
        {
            *num_kv_heads = self.to_kv_heads;
            *kv_latent_rank = self.latent.map(|l| l.rank);
        }
        out
    }

    /// The original K/V head each query head reads.
    pub fn source_head(&self, query: usize) -> usize {
        query / (self.num_heads / self.from_kv_heads)
    }

    /// The query heads of new K/V group `j`.
    pub fn queries(&self, j: usize) -> std::ops::Range<usize> {
        let per = self.num_heads / self.to_kv_heads;
        j * per..(j + 1) * per
    }

    /// The distinct original K/V heads that new group `j`'s queries read, in order.
    pub fn sources(&self, j: usize) -> Vec<usize> {
        let mut heads: Vec<usize> = self.queries(j).map(|q| self.source_head(q)).collect();
        heads.dedup();
        heads
    }

    /// True when the conversion loses nothing, so no method or calibration is needed: every
    /// new group reads a single original head (heads repeated or kept), or a latent has
    /// the full rank.
    pub fn is_exact(&self) -> bool {
        let heads_kept = (0..self.to_kv_heads).all(|j| self.sources(j).len() == 1);
        heads_kept && self.latent.is_none_or(|l| l.fitted() == l.full)
    }

    /// True when an aware MLA fit also reads how the original's heads attend (the rotation
    /// each expects, [`super::rotation`]): the calibration keeps its windows for it.
    pub fn turns(&self) -> bool {
        let mla = self.latent.is_some_and(|l| l.rope.is_some());
        mla && self.method == Method::Aware && !self.is_exact()
    }
}
