//! Reads RoPE parameters from either key layout: transformers 5's `rope_parameters`, or the
//! older top-level `rope_theta` + `rope_scaling`.

use super::{Error, HfConfig, Result};
use serde::Deserialize;

/// RoPE parameters: transformers 5's `rope_parameters`, or an older top-level `rope_scaling`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct HfRope {
    pub rope_type: Option<String>,
    /// Older checkpoints spell `rope_type` as `type`.
    #[serde(rename = "type")]
    pub type_: Option<String>,
    pub rope_theta: Option<f64>,
    pub factor: Option<f64>,
    pub low_freq_factor: Option<f64>,
    pub high_freq_factor: Option<f64>,
    pub original_max_position_embeddings: Option<usize>,
    pub beta_fast: Option<f64>,
    pub beta_slow: Option<f64>,
    pub mscale: Option<f64>,
    pub mscale_all_dim: Option<f64>,
    pub attention_factor: Option<f64>,
    pub truncate: Option<bool>,
    pub partial_rotary_factor: Option<f64>,
}

/// RoPE frequency scaling, one variant per `rope_type` the engine implements.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    Default,
    Linear {
        factor: f64,
    },
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max: usize,
    },
    Yarn(YarnScaling),
}

#[derive(Debug, Clone, PartialEq)]
pub struct YarnScaling {
    /// The factor the frequencies are interpolated by.
    pub factor: f64,
    pub original_max: usize,
    pub beta_fast: f64,
    pub beta_slow: f64,
    /// Multiplies cos and sin (transformers' `attention_scaling`).
    pub attention_factor: f64,
    pub truncate: bool,
    /// DeepSeek's `mscale_all_dim` (0 when absent): also scales the MLA softmax.
    pub mscale_all_dim: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    /// Width of the rotated part of each head.
    pub dim: usize,
    pub scaling: RopeScaling,
    /// Pair dimension 2i with 2i+1 (DeepSeek's `rope_interleave`) instead of i with i + dim/2.
    pub interleaved: bool,
}

fn required(rope_type: &str, field: &str, value: Option<f64>) -> Result<f64> {
    match value {
        Some(v) if v.is_finite() && v > 0.0 => Ok(v),
        Some(v) => Err(Error::Config(format!(
            "rope {rope_type}: {field} must be positive, got {v}"
        ))),
        None => Err(Error::Config(format!("rope {rope_type}: missing {field}"))),
    }
}

/// yarn's attention scaling: `0.1·mscale·ln(factor) + 1` for factor > 1.
pub fn yarn_get_mscale(factor: f64, mscale: f64) -> f64 {
    if factor <= 1.0 {
        1.0
    } else {
        0.1 * mscale * factor.ln() + 1.0
    }
}

pub(super) fn resolve(hf: &HfConfig, dim: usize, interleaved: bool) -> Result<RopeConfig> {
    let params = hf
        .rope_parameters
        .clone()
        .or_else(|| hf.rope_scaling.clone())
        .unwrap_or_default();
    let theta = params.rope_theta.or(hf.rope_theta).unwrap_or(10_000.0);
    if !(theta.is_finite() && theta > 0.0) {
        return Err(Error::Config(format!(
            "rope_theta must be positive, got {theta}"
        )));
    }
    if let Some(p) = params.partial_rotary_factor.filter(|p| *p != 1.0) {
        return Err(Error::Config(format!(
            "partial_rotary_factor {p} is not supported (1.0)"
        )));
    }
    let rope_type = params
        .rope_type
        .clone()
        .or(params.type_.clone())
        .unwrap_or("default".into());
    let context = hf.max_position_embeddings.max(1) as usize;
    let scaling = match rope_type.as_str() {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear {
            factor: required("linear", "factor", params.factor)?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: required("llama3", "factor", params.factor)?,
            low_freq_factor: required("llama3", "low_freq_factor", params.low_freq_factor)?,
            high_freq_factor: required("llama3", "high_freq_factor", params.high_freq_factor)?,
            original_max: params.original_max_position_embeddings.ok_or_else(|| {
                Error::Config("rope llama3: missing original_max_position_embeddings".into())
            })?,
        },
        "yarn" => RopeScaling::Yarn(yarn(&params, context)?),
        other => {
            return Err(Error::Config(format!(
                "rope_type {other:?} is not supported (default, linear, llama3, yarn)"
            )))
        }
    };
    Ok(RopeConfig {
        theta,
        dim,
        scaling,
        interleaved,
    })
}

/// Mirrors transformers' `_compute_yarn_parameters`.
fn yarn(p: &HfRope, context: usize) -> Result<YarnScaling> {
    let original_max = p
        .original_max_position_embeddings
        .filter(|o| *o > 0)
        .unwrap_or(context);
    // Without an explicit factor, transformers uses the ratio of the two context lengths.
    let factor = match p.factor {
        Some(_) => required("yarn", "factor", p.factor)?,
        None => context as f64 / original_max as f64,
    };
    let mscale = p.mscale.unwrap_or(0.0);
    let mscale_all_dim = p.mscale_all_dim.unwrap_or(0.0);
    let attention_factor = match p.attention_factor {
        Some(a) => a,
        None if mscale != 0.0 && mscale_all_dim != 0.0 => {
            yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        }
        None => yarn_get_mscale(factor, 1.0),
    };
    Ok(YarnScaling {
        factor,
        original_max,
        beta_fast: p.beta_fast.unwrap_or(32.0),
        beta_slow: p.beta_slow.unwrap_or(1.0),
        attention_factor,
        truncate: p.truncate.unwrap_or(true),
        mscale_all_dim,
    })
}
