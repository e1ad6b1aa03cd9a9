//! The attention layer, chosen by config: [`GqaAttention`] for MHA/MQA/GQA,
//! [`LowRankAttention`] for GQA with low-rank K/V (a converted checkpoint's), [`MlaAttention`]
//! for DeepSeek's latent attention. All end in the one [`sdpa`].

pub mod decode;
mod gqa;
mod lowrank;
mod mla;
mod prompt;
mod spans;

pub use gqa::GqaAttention;
pub use lowrank::LowRankAttention;
pub use mla::MlaAttention;
pub use spans::sdpa_spans;

use super::linear::simd;
use super::rope::Rotation;
use crate::config::{AttentionConfig, ModelConfig};
use crate::kv_cache::{Held, LayerView};
use candle_core::{DType, Device, Result, Tensor, D};
use candle_nn::VarBuilder;

#[derive(Debug, Clone)]
pub enum Attention {
    Gqa(GqaAttention),
    LowRank(LowRankAttention),
    Mla(MlaAttention),
}

impl Attention {
    pub fn new(cfg: &ModelConfig, vb: VarBuilder) -> Result<Self> {
        Ok(match &cfg.attention {
            AttentionConfig::Gqa {
                kv_latent_rank: Some(_),
                ..
            } => Attention::LowRank(LowRankAttention::new(cfg, vb)?),
            AttentionConfig::Gqa { .. } => Attention::Gqa(GqaAttention::new(cfg, vb)?),
            AttentionConfig::Mla(_) => Attention::Mla(MlaAttention::new(cfg, vb)?),
        })
    }

    /// Quantizes the layer's projections; returns the bytes saved.
    pub fn quantize(&mut self, q: &dyn crate::model::linear::Quantizer) -> Result<usize> {
        match self {
            Attention::Gqa(a) => a.quantize(q),
            Attention::LowRank(a) => a.quantize(q),
            Attention::Mla(a) => a.quantize(q),
        }
    }

    /// x: (1, N, C), the packed tokens of every sequence in `spans`, each attending over
    /// its own cache (`caches[i]` is span i's); returns (1, N, C).
    pub fn forward(
        &self,
        x: &Tensor,
        rope: &Rotation,
        spans: &[Span],
        caches: &[LayerView],
    ) -> Result<Tensor> {
        match self {
            Attention::Gqa(a) => a.forward(x, rope, spans, caches),
            Attention::LowRank(a) => a.forward(x, rope, spans, caches),
            Attention::Mla(a) => a.forward(x, rope, spans, caches),
        }
    }
}

/// One sequence's tokens in a packed step: rows `start..start + len` of the step's tokens, at
/// positions `pos..pos + len` of its own cache.
///
/// The sequences of a batch are packed one after another rather than padded to one length,
/// so that the projections and the MLP run once over the tokens that exist (a decode step of
/// eight sequences is one 8-row product, and a newcomer's prompt chunk rides along without
/// padding the others to its length), and only attention is per sequence: a sequence's
/// queries see its own cache alone, so no position of one sequence reaches another's.
#[derive(Debug, Clone)]
pub struct Span {
    pub start: usize,
    pub len: usize,
    pub pos: usize,
    /// The causal (and sliding-window) mask of the span's queries over its `pos + len` keys;
    /// `None` for a single token that sees every cached key.
    pub mask: Option<Tensor>,
}

impl Span {
    pub fn new(start: usize, len: usize, pos: usize, window: usize, dev: &Device) -> Result<Self> {
        let s = pos + len;
        let mask = match len > 1 || s > window {
            true => Some(causal_mask(len, s, window, DType::F32, dev)?),
            false => None,
        };
        Ok(Self {
            start,
            len,
            pos,
            mask,
        })
    }

    /// This span's rows of `x` along dimension `dim`.
    pub fn rows(&self, x: &Tensor, dim: usize) -> Result<Tensor> {
        x.narrow(dim, self.start, self.len)
    }
}

/// The spans' results, each (1, len, width), back in one (1, N, width) tensor.
pub fn join(parts: Vec<Tensor>) -> Result<Tensor> {
    match parts.len() {
        1 => Ok(parts.into_iter().next().expect("one part")),
        _ => Tensor::cat(&parts, 1),
    }
}

/// Additive mask (T, S) for T queries at the end of S keys: 0 where key j is visible to query
/// i (causal, and fewer than `window` positions back), -inf elsewhere.
pub fn causal_mask(
    t: usize,
    s: usize,
    window: usize,
    dtype: DType,
    dev: &Device,
) -> Result<Tensor> {
    let offset = s - t;
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| {
            let q = offset + i;
            (0..s).map(move |j| {
                if j > q || q - j >= window {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
        })
        .collect();
    Tensor::from_vec(mask, (t, s), dev)?.to_dtype(dtype)
}

/// Scaled dot-product attention with grouped heads. One new token without a mask takes
/// [`decode::DecodeAttention`] where it runs; a masked prompt of more than 16 query rows a
/// group, in f32 on CPU, [`prompt::attention`] (one pass per piece of queries); everything
/// else (a few rows, no mask, another device) the scores and [`attend`], which MLA's
/// prompt form shares.
///
/// q: (B, H, T, Dk); k: (B, G, S, Dk); v: (B, G, S, Dv) with H a multiple of G. The query is
/// reshaped to (B, G, H/G·T, Dk) so each group's heads share one K/V without copying it
/// (the repeat_kv of transformers is never done).
pub fn sdpa(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    let (b, h, t, dk) = q.dims4()?;
    let g = k.dim(1)?;
    if t == 1 && mask.is_none() && decode_takes(q, k, v) {
        let op = decode::DecodeAttention {
            scale: scale as f32,
            pages: None,
        };
        return q.contiguous()?.apply_op3_no_bwd(k, v, &op); // (B, H, 1, Dv)
    }
    let f32 = [q, k, v].iter().all(|t| t.dtype() == DType::F32);
    // A bf16 cache's keys meet the query rounded to bf16 where the CPU multiplies bf16
    // pairs, as the decode op's do ([`decode`]), so that a prompt and its decode agree.
    let pairs =
        k.dtype() == DType::BF16 && k.device().is_cpu() && simd::bf16_pairs(simd::Isa::current());
    if let (true, DType::BF16, Some(mask)) = (pairs, v.dtype(), mask) {
        // A prompt over a bf16 cache where the CPU multiplies bf16 pairs: q rounded to bf16
        // (as the decode op rounds it) and k, v read as they are, in one pass per piece of
        // query rows (`prompt/fused.rs`).
        let qb = q.to_dtype(DType::BF16)?.contiguous()?;
        let qb = qb.reshape((b, g, (h / g) * t, dk))?;
        if let Some(y) = prompt::attention(&qb, k, v, scale as f32, mask) {
            return y?.reshape((b, h, t, v.dim(3)?))?.to_dtype(q.dtype());
        }
    }
    if !f32 && q.device().is_cpu() {
        // candle's CPU matmul has no bf16/f16 kernel: each product would widen its operands
        // and narrow its result, the (.., T, S) scores four times over. In f32 from here on,
        // only q, k and v are widened (SmolLM-135M bf16 prefill of 512 tokens on the AVX2
        // host: 168 -> 186 tok/s, medians of 3 alternating runs).
        let w = |t: &Tensor| t.to_dtype(DType::F32);
        let qw = match pairs {
            true => w(&q.to_dtype(DType::BF16)?)?,
            false => w(q)?,
        };
        return sdpa(&qw, &w(k)?, &w(v)?, scale, mask)?.to_dtype(q.dtype());
    }
    let q = q.contiguous()?.reshape((b, g, (h / g) * t, dk))?; // (B, G, H/G·T, Dk)
    if let Some(y) = mask.and_then(|mask| prompt::attention(&q, k, v, scale as f32, mask)) {
        return y?.reshape((b, h, t, v.dim(3)?)); // (B, H, T, Dv)
    }
    let scores = match prompt::products(&q, k) {
        Some(scores) => scores?,
        None => q.matmul(&k.t()?)?,
    }; // (B, G, H/G·T, S)
    attend(&scores, v, h, t, scale, mask)
}

/// Whether the decode op takes these: one dtype throughout, or f32 queries over a bf16 cache.
fn decode_takes(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    let fits = k.dtype() == v.dtype() && (q.dtype() == k.dtype() || q.dtype() == DType::F32);
    fits && decode::takes(k)
}

/// [`sdpa`] over what a cache holds: a paged sequence's single new token reads the pool
/// through its block table in the decode op; anything else gathers its positions first.
pub fn sdpa_held(q: &Tensor, held: &Held, scale: f64, mask: Option<&Tensor>) -> Result<Tensor> {
    let (k, v) = (&held.k, &held.v);
    match held.pages {
        Some(pages) if q.dim(2)? == 1 && mask.is_none() && decode_takes(q, k, v) => {
            let op = decode::DecodeAttention {
                scale: scale as f32,
                pages: Some(pages),
            };
            q.contiguous()?.apply_op3_no_bwd(k, v, &op)
        }
        // One run (off the CPU, where the pool's tensors stay: `LayerView::write_held`):
        // views of its positions, as a cache of its own gives.
        Some(pages) if pages.table().is_none() => {
            let (k, v) = held.gathered()?;
            sdpa(q, &k, &v, scale, mask)
        }
        Some(_) => {
            let (k, v) = held.gathered()?;
            sdpa(q, &k, &v.contiguous()?, scale, mask)
        }
        None => sdpa(q, k, v, scale, mask),
    }
}

/// The shared tail of every attention: scale, mask, softmax (in f32), weighted sum of `v`.
///
/// scores: (B, G, H/G·T, S) raw dot products; v: (B, G, S, Dv). Returns (B, H, T, Dv).
pub fn attend(
    scores: &Tensor,
    v: &Tensor,
    h: usize,
    t: usize,
    scale: f64,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    let (b, g, _, s) = scores.dims4()?;
    let dv = v.dim(3)?;
    let att = scores.to_dtype(DType::F32)?;
    if let Some(weights) = mask.and_then(|mask| prompt::masked(&att, scale as f32, mask)) {
        let att = weights?.to_dtype(v.dtype())?;
        let y = match prompt::products(&att, &v.transpose(2, 3)?) {
            Some(y) => y?,
            None => att.matmul(v)?,
        };
        return y.reshape((b, h, t, dv)); // (B, H, T, Dv)
    }
    let att = (att * scale)?;
    let att = match mask {
        Some(mask) => att
            .reshape((b, g, h / g, t, s))?
            .broadcast_add(&mask.to_dtype(DType::F32)?)?,
        None => att,
    };
    let att = candle_nn::ops::softmax_last_dim(&att)?.to_dtype(v.dtype())?;
    let att = att.reshape((b, g, (h / g) * t, s))?;
    att.matmul(v)?.reshape((b, h, t, dv)) // (B, H, T, Dv)
}

/// The textbook attention, one head at a time with explicit K/V per head: tests compare
/// [`sdpa`] against it.
pub fn naive_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    let (h, g) = (q.dim(1)?, k.dim(1)?);
    let heads = (0..h)
        .map(|i| {
            let (q, k, v) = (
                q.narrow(1, i, 1)?,
                k.narrow(1, i / (h / g), 1)?,
                v.narrow(1, i / (h / g), 1)?,
            );
            let mut att = (q.matmul(&k.t()?)? * scale)?;
            if let Some(mask) = mask {
                att = att.broadcast_add(mask)?;
            }
            let att = candle_nn::ops::softmax(&att, D::Minus1)?;
            att.matmul(&v)
        })
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&heads, 1)
}
