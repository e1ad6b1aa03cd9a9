//! Multi-head attention with `num_kv_heads` key/value heads: MHA when it equals the number of
//! query heads, MQA when it is 1, GQA in between. One implementation for all three.

use super::{sdpa_spans, Span};
use crate::config::{AttentionConfig, ModelConfig};
use crate::kv_cache::LayerView;
use crate::model::linear::quantize_all;
use crate::model::linear::Quantizer;
use crate::model::linear::{forward_each, linear_b, Linear};
use crate::model::norm::RmsNorm;
use crate::model::rms_norm;
use crate::model::rope::Rotation;
use candle_core::{Error, Module, Result, Tensor};
use candle_nn::VarBuilder;

#[derive(Debug, Clone)]
pub struct GqaAttention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    /// Qwen3's per-head RMSNorm on q and k (over head_dim, before RoPE).
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    num_heads: usize,
    /// Divides `num_heads`; each group of num_heads / num_kv_heads query heads shares one K/V.
    num_kv_heads: usize,
    head_dim: usize,
}

impl GqaAttention {
    pub fn new(cfg: &ModelConfig, vb: VarBuilder) -> Result<Self> {
        let AttentionConfig::Gqa {
            num_kv_heads,
            head_dim,
            qkv_bias,
            o_bias,
            qk_norm,
            kv_latent_rank: None,
        } = cfg.attention
        else {
            return Err(Error::Msg("GqaAttention needs a GQA config".into()));
        };
        let (h, hidden) = (cfg.num_attention_heads, cfg.hidden_size);
        let norm = |name: &str| match qk_norm {
            true => rms_norm(head_dim, cfg.rms_norm_eps, vb.pp(name)).map(Some),
            false => Ok(None),
        };
        Ok(Self {
            q_proj: linear_b(hidden, h * head_dim, qkv_bias, vb.pp("q_proj"))?,
            k_proj: linear_b(hidden, num_kv_heads * head_dim, qkv_bias, vb.pp("k_proj"))?,
            v_proj: linear_b(hidden, num_kv_heads * head_dim, qkv_bias, vb.pp("v_proj"))?,
            o_proj: linear_b(h * head_dim, hidden, o_bias, vb.pp("o_proj"))?,
            q_norm: norm("q_norm")?,
            k_norm: norm("k_norm")?,
            num_heads: h,
            num_kv_heads,
            head_dim,
        })
    }

    /// Quantizes the four projections; returns the bytes saved.
    pub fn quantize(&mut self, q: &dyn Quantizer) -> Result<usize> {
        let (qp, kp, vp, op) = (
            &mut self.q_proj,
            &mut self.k_proj,
            &mut self.v_proj,
            &mut self.o_proj,
        );
        quantize_all(&mut [qp, kp, vp, op], q)
    }

    /// x: (1, N, C), the packed tokens of `spans` (see [`Span`]).
    pub fn forward(
        &self,
        x: &Tensor,
        rope: &Rotation,
        spans: &[Span],
        caches: &[LayerView],
    ) -> Result<Tensor> {
        let (b, n, _) = x.dims3()?;
        let (h, g, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        // 1. Project every token, split heads: (1, N, H, D)
        let [q, k, v] = forward_each(x, [&self.q_proj, &self.k_proj, &self.v_proj])?;
        let mut q = q.reshape((b, n, h, d))?;
        let mut k = k.reshape((b, n, g, d))?;
        let v = v.reshape((b, n, g, d))?;
        // 2. Qwen3's per-head norm
        if let (Some(q_norm), Some(k_norm)) = (&self.q_norm, &self.k_norm) {
            q = q_norm.forward(&q)?;
            k = k_norm.forward(&k)?;
        }
        // 3. RoPE on (1, H, N, D), each token at its own position
        let q = rope.apply(&q.transpose(1, 2)?)?;
        let k = rope.apply(&k.transpose(1, 2)?)?;
        let v = v.transpose(1, 2)?; // (1, G, N, D)

        // 4. Per sequence: write its tokens into its cache; attend over all it holds, the
        //    single new tokens of a batched step together
        let at: Vec<_> = spans.iter().map(|s| (s.start, s.len, s.pos)).collect();
        let helds = LayerView::write_held_all(caches, &k, &v, &at)?;
        let y = sdpa_spans(&q, &helds, spans, 1.0 / (d as f64).sqrt())?; // (1, N, H·D)

        // 5. Heads merged, output projection over every token
        self.o_proj.forward(&y)
    }
}
