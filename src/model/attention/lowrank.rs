//! GQA whose keys and values come from one low-rank latent of the attention input
//! (`kv_latent_rank` R, written by `convert --attention lowrank:R`). The cache holds the
//! R-wide latent alone; each step rebuilds the keys and values of every cached position from
//! it and rotates the keys at their positions (Palu's layout). Keeping RoPE on every key
//! dimension is what keeps the conversion close to the original, and what rules out MLA's
//! absorbed decode: the work of a step grows with the context (R × 2·G·D multiply-adds per
//! cached position and layer), which `bench` at a long context measures. The values need no
//! rebuilding for one new token: it attends over the latents themselves and each head
//! up-projects its result (MLA's absorbed output, `o = (p·C)·U_vᵀ`), which halves that work.

use super::{decode, join, sdpa, Span};
use crate::config::{AttentionConfig, ModelConfig};
use crate::kv_cache::LayerView;
use crate::model::linear::quantize_all;
use crate::model::linear::{linear_b, Linear, Quantizer};
use crate::model::norm::RmsNorm;
use crate::model::rope::{Rope, Rotation};
use crate::model::{activation_dtype, rms_norm};
use candle_core::{Error, Module, Result, Tensor};
use candle_nn::VarBuilder;

#[derive(Debug, Clone)]
pub struct LowRankAttention {
    q_proj: Linear,
    /// C → R: the latent the cache holds (with the q/k/v bias, when the model has one).
    kv_down: Linear,
    /// R → G·D each: the pre-RoPE keys and the values, rebuilt from the latent.
    k_up: Linear,
    v_up: Linear,
    /// v_up's weight per K/V head, (G, R, D) in the activations' dtype: the absorbed output
    /// of a decode step.
    w_uv: Tensor,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    /// The keys' rotation at positions 0..S, built per step for the rebuilt keys.
    rope: Rope,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

impl LowRankAttention {
    pub fn new(cfg: &ModelConfig, vb: VarBuilder) -> Result<Self> {
        let AttentionConfig::Gqa {
            num_kv_heads,
            head_dim,
            qkv_bias,
            o_bias,
            qk_norm,
            kv_latent_rank: Some(rank),
        } = cfg.attention
        else {
            return Err(Error::Msg("LowRankAttention needs kv_latent_rank".into()));
        };
        let (h, hidden, kv) = (
            cfg.num_attention_heads,
            cfg.hidden_size,
            num_kv_heads * head_dim,
        );
        let norm = |name: &str| match qk_norm {
            true => rms_norm(head_dim, cfg.rms_norm_eps, vb.pp(name)).map(Some),
            false => Ok(None),
        };
        let act = activation_dtype(vb.dtype(), vb.device());
        let v_up = linear_b(rank, kv, false, vb.pp("v_up"))?;
        let w_uv = v_up
            .weight()
            .ok_or_else(|| Error::Msg("v_up is quantized".into()))?
            .reshape((num_kv_heads, head_dim, rank))?
            .transpose(1, 2)?
            .to_dtype(act)?
            .contiguous()?;
        Ok(Self {
            q_proj: linear_b(hidden, h * head_dim, qkv_bias, vb.pp("q_proj"))?,
            kv_down: linear_b(hidden, rank, qkv_bias, vb.pp("kv_down"))?,
            k_up: linear_b(rank, kv, false, vb.pp("k_up"))?,
            v_up,
            w_uv,
            o_proj: linear_b(h * head_dim, hidden, o_bias, vb.pp("o_proj"))?,
            q_norm: norm("q_norm")?,
            k_norm: norm("k_norm")?,
            rope: Rope::new(&cfg.rope, act, vb.device())?,
            num_heads: h,
            num_kv_heads,
            head_dim,
        })
    }

    /// Quantizes the five projections; returns the bytes saved.
    pub fn quantize(&mut self, q: &dyn Quantizer) -> Result<usize> {
        let Self {
            q_proj,
            kv_down,
            k_up,
            v_up,
            o_proj,
            ..
        } = self;
        quantize_all(&mut [q_proj, kv_down, k_up, v_up, o_proj], q)
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
        // 1. Queries as in GQA; the latent of every token, (1, 1, N, R)
        let mut q = self.q_proj.forward(x)?.reshape((b, n, h, d))?;
        if let Some(q_norm) = &self.q_norm {
            q = q_norm.forward(&q)?;
        }
        let q = rope.apply(&q.transpose(1, 2)?)?;
        let latent = self.kv_down.forward(x)?.unsqueeze(1)?;
        let none = Tensor::zeros((b, 1, n, 0), x.dtype(), x.device())?;
        // 2. Per sequence: cache its latents, rebuild K and V of all it holds, attend
        let ys = spans
            .iter()
            .zip(caches)
            .map(|(span, cache)| {
                let rows = |t: &Tensor| span.rows(t, 2);
                let (c, _) = cache.write(&rows(&latent)?, &rows(&none)?, span.pos)?;
                let s = c.dim(2)?;
                let c = c.squeeze(1)?.to_dtype(x.dtype())?; // (1, S, R)
                let mut k = self.k_up.forward(&c)?.reshape((b, s, g, d))?;
                if let Some(k_norm) = &self.k_norm {
                    k = k_norm.forward(&k)?;
                }
                let positions: Vec<u32> = (0..s as u32).collect();
                let k = self
                    .rope
                    .at_positions(&positions)?
                    .apply(&k.transpose(1, 2)?)?;
                let (q, scale) = (rows(&q)?, 1.0 / (d as f64).sqrt());
                if span.len == 1 && span.mask.is_none() && decode::takes(&q) {
                    // One token: attend over the latents as every group's values (a view,
                    // no copy), then up-project each head's (1, R) result.
                    let r = c.dim(2)?;
                    let v = c.unsqueeze(1)?.broadcast_as((b, g, s, r))?;
                    let y = sdpa(&q, &k, &v, scale, None)?; // (1, H, 1, R)
                    let y = y.reshape((g, h / g, r))?.matmul(&self.w_uv)?; // (G, H/G, D)
                    return y.reshape((b, 1, h * d));
                }
                let v = self
                    .v_up
                    .forward(&c)?
                    .reshape((b, s, g, d))?
                    .transpose(1, 2)?;
                let y = sdpa(&q, &k, &v.contiguous()?, scale, span.mask.as_ref())?;
                y.transpose(1, 2)?.reshape((b, span.len, h * d)) // (1, len, H·D)
            })
            .collect::<Result<Vec<_>>>()?;
        // 3. Heads merged, output projection over every token
        self.o_proj.forward(&join(ys)?)
    }
}
