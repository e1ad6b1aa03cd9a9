//! What `mla:R,rope=W` asks of a checkpoint: whether its heads can hold the RoPE key
//! ([`mla_fits`]) and which layout holds the rest ([`mla_layout`]).

use super::super::spec::{bad, MlaLayout, Spec};
use crate::config::{MlpConfig, ModelConfig};
use crate::error::Result;

/// The MLA layout of `spec`: as asked, else DeepSeek's where it can hold the conversion
/// (one RoPE head, W = head_dim), else ours; attention biases need DeepSeek's.
pub(super) fn mla_layout(
    spec: &Spec,
    cfg: &ModelConfig,
    asked: Option<MlaLayout>,
    d: usize,
    w: usize,
    bias: bool,
) -> Result<MlaLayout> {
    let layout = match spec.anchored(d) {
        true => MlaLayout::Deepseek,
        false => asked.unwrap_or(MlaLayout::Ours),
    };
    if layout == MlaLayout::Deepseek && w != d {
        return Err(bad(format!(
            "{spec}: DeepSeek's layout has one RoPE key head, so rope must be head_dim ({d}); \
             use rope={d}, or layout=ours for {} RoPE heads",
            w / d
        )));
    }
    // What DeepSeek-V3's class has no place for must not be dropped silently.
    let mlp_bias = cfg
        .mlp
        .iter()
        .any(|m| matches!(m, MlpConfig::Dense { bias: true, .. }));
    let window = cfg.sliding_window < cfg.max_position_embeddings;
    if layout == MlaLayout::Deepseek && (mlp_bias || window) {
        let what = match mlp_bias {
            true => "MLP biases",
            false => "a sliding window",
        };
        return Err(bad(format!(
            "{spec}: DeepSeek-V3's layout has no {what}, which this model has; use \
             layout=ours (rope={d}) or lowrank:R"
        )));
    }
    if layout == MlaLayout::Ours && bias {
        return Err(bad(format!(
            "{spec}: our MLA layout has no attention biases (qwen2); use layout=deepseek \
             (rope={d}), which holds them"
        )));
    }
    Ok(layout)
}

/// Whether `mla:R,rope=W` can be built on this model: RoPE over whole heads, W a whole
/// number k of heads, k dividing the query heads, and each original K/V head either merged
/// into one RoPE head or copied (k dividing G, or G dividing k).
pub(super) fn mla_fits(spec: &Spec, cfg: &ModelConfig, g: usize, d: usize, w: usize) -> Result<()> {
    let h = cfg.num_attention_heads;
    if cfg.rope.dim != d {
        return Err(bad(format!(
            "{spec}: MLA needs RoPE over the whole head (rotary dim {} of head_dim {d}); \
             use lowrank:R",
            cfg.rope.dim
        )));
    }
    let k = w / d;
    let fits =
        w.is_multiple_of(d) && h.is_multiple_of(k) && (g.is_multiple_of(k) || k.is_multiple_of(g));
    if !fits || k == 0 {
        let ok: Vec<String> = (1..=h)
            .filter(|&k| h.is_multiple_of(k) && (g.is_multiple_of(k) || k.is_multiple_of(g)))
            .map(|k| (k * d).to_string())
            .collect();
        return Err(bad(format!(
            "{spec}: the RoPE key must be whole heads of {d} dims whose number divides the \
             {h} query heads and divides or is a multiple of the {g} K/V heads: rope={}",
            ok.join(", rope=")
        )));
    }
    Ok(())
}
