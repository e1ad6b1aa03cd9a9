//! One decoder layer: pre-norm residual wiring around attention and the MLP.

use super::attention::{Attention, Span};
use super::mlp::Mlp;
use super::rope::Rotation;
use crate::config::ModelConfig;
use crate::kv_cache::LayerView;
use crate::model::norm::RmsNorm;
use crate::model::rms_norm;
use candle_core::{Module, Result, Tensor};
use candle_nn::VarBuilder;

#[derive(Debug, Clone)]
pub struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

impl DecoderLayer {
    pub fn new(cfg: &ModelConfig, layer: usize, vb: VarBuilder) -> Result<Self> {
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        Ok(Self {
            input_layernorm: rms_norm(h, eps, vb.pp("input_layernorm"))?,
            self_attn: Attention::new(cfg, vb.pp("self_attn"))?,
            post_attention_layernorm: rms_norm(h, eps, vb.pp("post_attention_layernorm"))?,
            mlp: Mlp::new(cfg, layer, vb.pp("mlp"))?,
        })
    }

    /// x: (1, N, C), the packed tokens of `spans`, each sequence with its own cache ->
    /// (1, N, C).
    pub fn forward(
        &self,
        x: &Tensor,
        rope: &Rotation,
        spans: &[Span],
        caches: &[LayerView],
    ) -> Result<Tensor> {
        let attn =
            (self.self_attn).forward(&self.input_layernorm.forward(x)?, rope, spans, caches)?;
        let x = (x + attn)?;
        let mlp = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&x)?)?;
        x + mlp
    }

    /// What the attention sees of `x`: the normed hidden state.
    pub fn attention_input(&self, x: &Tensor) -> Result<Tensor> {
        self.input_layernorm.forward(x)
    }

    /// Quantizes the attention and MLP projections; returns the bytes saved.
    pub fn quantize(&mut self, q: &dyn crate::model::linear::Quantizer) -> Result<usize> {
        Ok(self.self_attn.quantize(q)? + self.mlp.quantize(q)?)
    }

    pub fn self_attn(&self) -> &Attention {
        &self.self_attn
    }
}
