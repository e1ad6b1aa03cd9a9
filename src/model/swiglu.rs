//! The dense feed-forward block: `down_proj(silu(gate_proj(x)) * up_proj(x))`, a layer's MLP
//! in Llama-family models and each expert of a mixture of experts.

use super::linear::{linear_b, quantize_all, Linear, Quantizer};
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
