//! `--attention SPEC`: what a user asks for (`mha`, `mqa`, `gqa:G`, `mla:R,rope=W`,
//! `lowrank:R`, each with `,method=...`), parsed and printed back; `super::plan` checks it
//! against a checkpoint.

use crate::error::{Error, Result};
use std::fmt;

/// The attention layout asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// One K/V head per query head.
    Mha,
    /// One K/V head for all query heads.
    Mqa,
    /// G K/V heads.
    Gqa(usize),
    /// Cacheable MLA: a rank-R latent and a RoPE key W wide (see `convert::mla`), in the
    /// layout asked for (`None`: DeepSeek's where it can hold the conversion, see
    /// [`super::Plan`]).
    Mla {
        rank: usize,
        rope: usize,
        layout: Option<MlaLayout>,
    },
    /// A rank-R latent of the pre-RoPE keys and values, keys rebuilt and rotated when
    /// attending (see `convert::lowrank`).
    LowRank { rank: usize },
}

/// How an MLA conversion is laid out (`layout=deepseek|ours`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlaLayout {
    /// DeepSeek's, as transformers' `DeepseekV3ForCausalLM` loads it: one shared RoPE key
    /// head, the latent's RMSNorm, a plain `q_proj` or (for a query bias) `q_a_proj` +
    /// `q_a_layernorm` + `q_b_proj` (see `convert::deepseek`). Needs rope=head_dim.
    Deepseek,
    /// Ours, which loads here only: `rope_groups` RoPE heads, no latent norm, no biases.
    Ours,
}

impl MlaLayout {
    pub fn name(&self) -> &'static str {
        match self {
            MlaLayout::Deepseek => "deepseek",
            MlaLayout::Ours => "ours",
        }
    }
}

/// How a lossy conversion chooses its weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// Mean of the original K/V heads of each new group (the GQA paper's uptraining start).
    Mean,
    /// Truncated SVD of the weights alone (MLA and low-rank only).
    Svd,
    /// Fitted to the activations of a calibration text (see `convert::gqa`).
    Aware,
}

/// A parsed `--attention` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spec {
    pub layout: Layout,
    /// `None`: the best method the layout has.
    pub method: Option<Method>,
}

impl Method {
    fn parse(s: &str) -> Result<Self> {
        match s {
            "mean" => Ok(Method::Mean),
            "svd" => Ok(Method::Svd),
            "aware" => Ok(Method::Aware),
            _ => Err(bad(format!("unknown method {s:?}: use mean, svd or aware"))),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Method::Mean => "mean",
            Method::Svd => "svd",
            Method::Aware => "aware",
        }
    }
}

pub(super) fn bad(msg: impl fmt::Display) -> Error {
    Error::Invalid(format!("--attention: {msg}"))
}

/// A positive count such as `G` or `R`.
fn count(what: &str, s: &str) -> Result<usize> {
    match s.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(bad(format!("{what} must be a positive integer, got {s:?}"))),
    }
}

impl std::str::FromStr for Spec {
    type Err = Error;

    /// `mha`, `mqa`, `gqa:G`, `mla:R,rope=W`, `lowrank:R`, then `,key=value` options.
    fn from_str(s: &str) -> Result<Self> {
        let mut parts = s.trim().split(',');
        let head = parts.next().unwrap_or_default();
        let (name, arg) = match head.split_once(':') {
            Some((n, a)) => (n, Some(a)),
            None => (head, None),
        };
        let (mut method, mut rope, mut mla_layout) = (None, None, None);
        for part in parts {
            match part.split_once('=') {
                Some(("method", m)) => method = Some(Method::parse(m)?),
                Some(("rope", w)) if name == "mla" => rope = Some(count("rope width W", w)?),
                Some(("layout", "deepseek")) if name == "mla" => {
                    mla_layout = Some(MlaLayout::Deepseek)
                }
                Some(("layout", "ours")) if name == "mla" => mla_layout = Some(MlaLayout::Ours),
                _ => return Err(bad(format!("unknown option {part:?} in {s:?}"))),
            }
        }
        let layout = match (name, arg) {
            ("mha", None) => Layout::Mha,
            ("mqa", None) => Layout::Mqa,
            ("gqa", Some(g)) => Layout::Gqa(count("gqa:G", g)?),
            ("mla", Some(r)) => match rope {
                Some(rope) => Layout::Mla {
                    rank: count("mla:R", r)?,
                    rope,
                    layout: mla_layout,
                },
                None => return Err(bad(format!("{s:?} needs a RoPE width: mla:R,rope=W"))),
            },
            ("lowrank", Some(r)) => Layout::LowRank {
                rank: count("lowrank:R", r)?,
            },
            _ => {
                return Err(bad(format!(
                    "unknown attention {s:?}: use mha, mqa, gqa:G, mla:R,rope=W or lowrank:R"
                )))
            }
        };
        Ok(Spec { layout, method })
    }
}

impl fmt::Display for Spec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.layout {
            Layout::Mha => write!(f, "mha")?,
            Layout::Mqa => write!(f, "mqa")?,
            Layout::Gqa(g) => write!(f, "gqa:{g}")?,
            Layout::Mla { rank, rope, layout } => {
                write!(f, "mla:{rank},rope={rope}")?;
                if let Some(l) = layout {
                    write!(f, ",layout={}", l.name())?;
                }
            }
            Layout::LowRank { rank } => write!(f, "lowrank:{rank}")?,
        }
        match self.method {
            Some(m) => write!(f, ",method={}", m.name()),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_print_back() {
        for s in [
            "mha",
            "mqa",
            "gqa:3",
            "mqa,method=mean",
            "gqa:2,method=aware",
            "mla:64,rope=64",
            "mla:64,rope=64,layout=ours",
            "mla:64,rope=64,layout=deepseek,method=svd",
            "lowrank:128,method=svd",
        ] {
            assert_eq!(s.parse::<Spec>().unwrap().to_string(), s);
        }
        for s in [
            "",
            "gqa",
            "gqa:0",
            "gqa:x",
            "mha:2",
            "mqa,method=best",
            "mla:64",
            "mqa,rope=4",
            "mla:64,rope=64,layout=v2",
            "gqa:2,layout=ours",
        ] {
            assert!(s.parse::<Spec>().is_err(), "{s:?} parsed");
        }
    }
}
