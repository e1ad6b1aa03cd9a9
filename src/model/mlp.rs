//! The feed-forward part of a layer: a dense SwiGLU, or DeepSeek's mixture of experts.

use super::linear::Quantizer;
use super::moe::Moe;
use super::swiglu::SwiGlu;
use crate::config::{MlpConfig, ModelConfig};
use candle_core::{Module, Result, Tensor};
use candle_nn::VarBuilder;

#[derive(Debug, Clone)]
pub enum Mlp {
    Dense(SwiGlu),
    Moe(Moe),
}

impl Mlp {
    pub fn new(cfg: &ModelConfig, layer: usize, vb: VarBuilder) -> Result<Self> {
        Ok(match &cfg.mlp[layer] {
            MlpConfig::Dense {
                intermediate_size,
                bias,
            } => Mlp::Dense(SwiGlu::new(cfg.hidden_size, *intermediate_size, *bias, vb)?),
            MlpConfig::Moe(moe) => Mlp::Moe(Moe::new(cfg.hidden_size, moe, vb)?),
        })
    }
}

impl Mlp {
    /// Quantizes every projection (the MoE router stays in f32); returns the bytes saved.
    pub fn quantize(&mut self, q: &dyn Quantizer) -> Result<usize> {
        match self {
            Mlp::Dense(mlp) => mlp.quantize(q),
            Mlp::Moe(moe) => moe.quantize(q),
        }
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Mlp::Dense(mlp) => mlp.forward(x),
            Mlp::Moe(moe) => moe.forward(x),
        }
    }
}
