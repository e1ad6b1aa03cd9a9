//! The feed-forward part of a layer: a dense SwiGLU, or DeepSeek's mixture of experts.

use super::linear::Quantizer;
use super::linear::{linear_b, Linear};
use super::moe::Moe;
use crate::config::{MlpConfig, ModelConfig};
use candle_core::{Module, Result, Tensor};
use candle_nn::VarBuilder;

/// `down_proj(silu(gate_proj(x)) * up_proj(x))`.
#[derive(Debug, Clone)]
pub struct SwiGlu {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl SwiGlu {
    pub fn new(hidden: usize, intermediate: usize, bias: bool, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            gate_proj: linear_b(hidden, intermediate, bias, vb.pp("gate_proj"))?,
            up_proj: linear_b(hidden, intermediate, bias, vb.pp("up_proj"))?,
            down_proj: linear_b(intermediate, hidden, bias, vb.pp("down_proj"))?,
        })
    }

    /// Quantizes the three projections (see [`Linear::quantize`]); returns the bytes saved.
    pub fn quantize(&mut self, q: &dyn Quantizer) -> Result<usize> {
        quantize_all(
            &mut [&mut self.gate_proj, &mut self.up_proj, &mut self.down_proj],
            q,
        )
    }

    /// Builds an expert from weights already in memory (transformers' fused expert tensors).
    pub fn from_weights(gate: Tensor, up: Tensor, down: Tensor) -> Self {
        Self {
            gate_proj: Linear::new(gate, None),
            up_proj: Linear::new(up, None),
            down_proj: Linear::new(down, None),
        }
    }
}

impl Module for SwiGlu {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gate = candle_nn::ops::silu(&self.gate_proj.forward(x)?)?;
        self.down_proj.forward(&(gate * self.up_proj.forward(x)?)?)
    }
}

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

/// Quantizes each of `linears` whose rows are whole blocks; returns the bytes saved.
pub fn quantize_all(linears: &mut [&mut Linear], q: &dyn Quantizer) -> Result<usize> {
    let mut saved = 0;
    for l in linears.iter_mut() {
        let before = l.weight_bytes();
        if l.quantize(q)? {
            saved += before - l.weight_bytes();
        }
    }
    Ok(saved)
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Mlp::Dense(mlp) => mlp.forward(x),
            Mlp::Moe(moe) => moe.forward(x),
        }
    }
}
