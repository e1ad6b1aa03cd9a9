//! DeepSeek-V2/V3 config fields: multi-head latent attention and the mixture of experts.
//! In these configs `head_dim` is not the attention head size; the MLA fields are.

use super::{Error, Result};
use serde::Deserialize;

/// The DeepSeek-only keys of config.json (flattened into [`super::HfConfig`]).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct HfDeepseek {
    /// `null` in V2-Lite: the query is a plain `q_proj`.
    pub q_lora_rank: Option<i64>,
    pub kv_lora_rank: Option<i64>,
    pub qk_nope_head_dim: Option<i64>,
    pub qk_rope_head_dim: Option<i64>,
    pub v_head_dim: Option<i64>,
    pub rope_interleave: Option<bool>,
    /// Ours, in MLA converted from GQA (see [`MlaConfig::rope_groups`]); absent: 1 and true.
    pub rope_groups: Option<i64>,
    pub kv_latent_norm: Option<bool>,
    pub n_routed_experts: Option<i64>,
    pub n_shared_experts: Option<i64>,
    pub num_experts_per_tok: Option<i64>,
    pub moe_intermediate_size: Option<i64>,
    pub first_k_dense_replace: Option<i64>,
    pub n_group: Option<i64>,
    pub topk_group: Option<i64>,
    pub topk_method: Option<String>,
    pub scoring_func: Option<String>,
    pub norm_topk_prob: Option<bool>,
    pub routed_scaling_factor: Option<f64>,
}

/// Resolved MLA sizes.
#[derive(Debug, Clone, PartialEq)]
pub struct MlaConfig {
    /// 0 means no query compression: `q_proj` instead of `q_a_proj`/`q_b_proj`.
    pub q_lora_rank: usize,
    /// Width of the cached latent `c_kv`.
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// `mscale² / sqrt(qk_nope_head_dim + qk_rope_head_dim)`.
    pub softmax_scale: f64,
    /// Bias on q_a_proj, kv_a_proj_with_mqa and o_proj (`attention_bias`).
    pub bias: bool,
    /// Ours, for MLA converted from a GQA checkpoint (`--attention mla:R,rope=W`; DeepSeek:
    /// 1 and true). The RoPE key and each query's RoPE part are `rope_groups` heads of
    /// `qk_rope_head_dim / rope_groups` dims, each rotated as one head at the model's
    /// frequencies (a query reads the group its original K/V head merged into), and
    /// `latent_norm: false` drops `kv_a_layernorm`, which no linear map of GQA's keys and
    /// values can reproduce.
    pub rope_groups: usize,
    pub latent_norm: bool,
}

/// How the router turns scores into expert choices.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Router {
    /// V2: softmax scores; `group_limited` keeps only the `topk_group` best groups.
    Softmax { group_limited: bool },
    /// V3: sigmoid scores; `e_score_correction_bias` picks experts but does not weight them.
    SigmoidGrouped,
}

/// Resolved MoE sizes for one MoE layer.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub n_routed_experts: usize,
    pub n_shared_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub router: Router,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f64,
}

fn need(field: &str, value: Option<i64>) -> Result<usize> {
    match value {
        Some(v) => super::positive(field, v),
        None => Err(Error::Config(format!(
            "missing {field} (required for deepseek models)"
        ))),
    }
}

/// The MLA attention of a config (DeepSeek's, or ours in a converted Llama-family
/// checkpoint) and its RoPE, pairs interleaved unless the config says otherwise.
pub(super) fn attention(
    hf: &super::HfConfig,
    interleave: bool,
) -> Result<(super::AttentionConfig, super::RopeConfig)> {
    let d = &hf.deepseek;
    let mla = MlaConfig {
        q_lora_rank: match d.q_lora_rank {
            Some(r) => super::positive("q_lora_rank", r)?,
            None => 0,
        },
        kv_lora_rank: need("kv_lora_rank", d.kv_lora_rank)?,
        qk_nope_head_dim: need("qk_nope_head_dim", d.qk_nope_head_dim)?,
        qk_rope_head_dim: need("qk_rope_head_dim", d.qk_rope_head_dim)?,
        v_head_dim: need("v_head_dim", d.v_head_dim)?,
        softmax_scale: 0.0,
        bias: hf.attention_bias,
        rope_groups: match d.rope_groups {
            Some(k) => super::positive("rope_groups", k)?,
            None => 1,
        },
        latent_norm: d.kv_latent_norm.unwrap_or(true),
    };
    let groups = mla.rope_groups;
    if !mla.qk_rope_head_dim.is_multiple_of(2 * groups) {
        return Err(Error::Config(format!(
            "qk_rope_head_dim ({}) must be {groups} (rope_groups) even-sized heads for RoPE",
            mla.qk_rope_head_dim
        )));
    }
    let rope = super::rope::resolve(hf, mla.qk_rope_head_dim / mla.rope_groups, interleave)?;
    let mut scale = 1.0 / ((mla.qk_nope_head_dim + mla.qk_rope_head_dim) as f64).sqrt();
    if let super::RopeScaling::Yarn(y) = &rope.scaling {
        if y.mscale_all_dim != 0.0 {
            let m = super::rope::yarn_get_mscale(y.factor, y.mscale_all_dim);
            scale *= m * m;
        }
    }
    let mla = MlaConfig {
        softmax_scale: scale,
        ..mla
    };
    Ok((super::AttentionConfig::Mla(mla), rope))
}

/// Resolves the MLA attention, its RoPE and the per-layer MLPs of a DeepSeek config.
pub(super) fn resolve(
    hf: &super::HfConfig,
    family: super::Family,
) -> Result<(
    super::AttentionConfig,
    super::RopeConfig,
    Vec<super::MlpConfig>,
)> {
    let d = &hf.deepseek;
    // V3 configs default to interleaved pairing; V2's modelling code always interleaves.
    let (mla, rope) = attention(hf, d.rope_interleave.unwrap_or(true))?;
    let layers = super::num_layers(hf)?;
    let dense = super::MlpConfig::Dense {
        intermediate_size: super::positive("intermediate_size", hf.intermediate_size)?,
        bias: hf.mlp_bias,
    };
    // As transformers builds it: dense MLPs before `first_k_dense_replace`, MoE from there on
    // (`moe_layer_freq`, found in some hub configs, is not read by transformers either).
    let first_dense = d.first_k_dense_replace.unwrap_or(0).max(0) as usize;
    let mlp = match d.n_routed_experts {
        Some(n) if n > 0 && first_dense < layers => {
            let moe = super::MlpConfig::Moe(moe(d, family)?);
            (0..layers)
                .map(|i| {
                    if i < first_dense {
                        dense.clone()
                    } else {
                        moe.clone()
                    }
                })
                .collect()
        }
        _ => vec![dense; layers],
    };
    Ok((mla, rope, mlp))
}

fn moe(d: &HfDeepseek, family: super::Family) -> Result<MoeConfig> {
    let n_routed_experts = need("n_routed_experts", d.n_routed_experts)?;
    let num_experts_per_tok = need("num_experts_per_tok", d.num_experts_per_tok)?;
    let n_group = match d.n_group {
        Some(g) => super::positive("n_group", g)?,
        None => 1,
    };
    let topk_group = match d.topk_group {
        Some(g) => super::positive("topk_group", g)?,
        None => n_group,
    };
    if n_routed_experts % n_group != 0 || topk_group > n_group {
        return Err(Error::Config(format!(
            "n_routed_experts ({n_routed_experts}) must be a multiple of n_group ({n_group}) \
             and topk_group ({topk_group}) at most n_group"
        )));
    }
    if num_experts_per_tok > n_routed_experts {
        return Err(Error::Config(format!(
            "num_experts_per_tok ({num_experts_per_tok}) exceeds n_routed_experts ({n_routed_experts})"
        )));
    }
    let router = match (family, d.topk_method.as_deref()) {
        (super::Family::DeepseekV3, _) => Router::SigmoidGrouped,
        (_, None | Some("greedy")) => Router::Softmax {
            group_limited: false,
        },
        (_, Some("group_limited_greedy")) => Router::Softmax {
            group_limited: true,
        },
        (_, Some(other)) => {
            return Err(Error::Config(format!(
                "topk_method {other:?} is not supported (greedy, group_limited_greedy)"
            )))
        }
    };
    Ok(MoeConfig {
        n_routed_experts,
        n_shared_experts: d.n_shared_experts.unwrap_or(0).max(0) as usize,
        num_experts_per_tok,
        moe_intermediate_size: need("moe_intermediate_size", d.moe_intermediate_size)?,
        n_group,
        topk_group,
        router,
        norm_topk_prob: d.norm_topk_prob.unwrap_or(false),
        routed_scaling_factor: d.routed_scaling_factor.unwrap_or(1.0),
    })
}
