//! `mla:R,rope=D,layout=deepseek`: an MLA conversion (see [`super::mla`]) in DeepSeek's
//! standard layout, the tensors transformers' `DeepseekV3ForCausalLM` (and any engine that
//! runs DeepSeek-V3) loads as they are.
//!
//! Two things of that layout have no linear counterpart in a GQA checkpoint: the RMSNorm
//! on the latent (`kv_a_layernorm`), and projections without a constant term where the
//! query has a bias (Qwen2's `q_proj` bias; DeepSeek's `q_proj` has none). Both are met by
//! an **anchor**: one more channel beside the vector u that is normalised (the latent, or
//! the query's input x), held at a constant A by the projection's bias
//! (`attention_bias: true`). With A ≫ |u| the norm's root mean square is A/√(n+1) whatever
//! u is, so the norm becomes a fixed scale, undone by its weight and the next projection,
//! and the anchor's normalised value is the constant √(n+1) that carries a bias through
//! the next projection. The relative error is |u|²/(2A²); A is chosen 2¹⁰ times a bound on
//! |u| taken from the weights (the attention's input is RMS-normalised, so
//! |x| ≤ √C·max|γ| of its `input_layernorm`), which puts it below 5e-7 for every input.
//! What it costs: one of the latent's R channels (the keys and values are fitted at rank
//! R − 1, so the cache is the size asked for and its rows stay a multiple of the SIMD
//! width), and for a query bias a (C + 1)-wide q-LoRA in place of `q_proj`.

use super::mla::Mla;
use crate::error::Result;
use candle_core::{DType, Device, Tensor};

/// How far above the bound on |u| the anchor sits, in powers of two.
const HEADROOM: i32 = 10;

/// The anchor for a normalised vector of `n` values with |u| ≤ `bound`.
struct Anchor {
    /// The anchor channel's value before the norm: a power of two, exact in bf16 and f16.
    a: f64,
    /// The norm's weight on u's channels: a power of two near A/√(n+1).
    gamma: f64,
    /// What the norm does to u's channels: y = u · scale.
    scale: f64,
    /// The anchor channel after the norm (its weight is 1).
    constant: f64,
}

impl Anchor {
    fn new(bound: f64, n: usize) -> Self {
        let a = 2f64.powi(bound.max(1e-6).log2().ceil() as i32 + HEADROOM);
        let rms = a / ((n + 1) as f64).sqrt();
        let gamma = 2f64.powi(rms.log2().round() as i32);
        Self {
            a,
            gamma,
            scale: gamma / rms,
            constant: ((n + 1) as f64).sqrt(),
        }
    }

    /// The norm's weight: `gamma` on the n channels of u, 1 on the anchor.
    fn norm_weight(&self, n: usize) -> Result<Tensor> {
        let mut w = vec![self.gamma as f32; n];
        w.push(1.0);
        Ok(Tensor::new(w, &Device::Cpu)?)
    }
}

/// One layer's attention tensors in DeepSeek's layout, by name under `self_attn.`, f32.
///
/// `mla` is the conversion in our layout (one RoPE head: rope = head_dim), its projections
/// augmented with their bias column; `gamma_max` the largest |weight| of the layer's
/// `input_layernorm`; `q_bias`: the query has a bias, so it goes through q-LoRA.
pub fn standard(
    mla: &Mla,
    c: usize,
    gamma_max: f64,
    q_bias: bool,
) -> Result<Vec<(String, Tensor)>> {
    let f32 = |t: Tensor| t.to_dtype(DType::F32);
    let cpu = &Device::Cpu;
    let x_bound = (c as f64).sqrt() * gamma_max;
    let mut out = Vec::new();
    // 1. The query: q_proj, or (for a bias) x and the anchor through q-LoRA.
    let (q_w, q_b) = (mla.q.narrow(1, 0, c)?, mla.q.narrow(1, c, 1)?);
    if !q_bias {
        out.push(("q_proj.weight".into(), f32(q_w)?));
    } else {
        let anchor = Anchor::new(x_bound, c);
        let eye = Tensor::eye(c, DType::F64, cpu)?;
        let a_w = Tensor::cat(&[&eye, &Tensor::zeros((1, c), DType::F64, cpu)?], 0)?;
        let mut a_b = vec![0f32; c];
        a_b.push(anchor.a as f32);
        let b_w = Tensor::cat(&[(q_w / anchor.scale)?, (q_b / anchor.constant)?], 1)?;
        out.push(("q_a_proj.weight".into(), f32(a_w)?));
        out.push(("q_a_proj.bias".into(), Tensor::new(a_b, cpu)?));
        out.push(("q_a_layernorm.weight".into(), anchor.norm_weight(c)?));
        out.push(("q_b_proj.weight".into(), f32(b_w)?));
    }
    // 2. The latent u = W·x + b (R − 1 values), its anchor, then the RoPE key (W values).
    let r = mla.kv_b.dim(1)?;
    let (latent, rope) = (
        mla.kv_a.narrow(0, 0, r)?,
        mla.kv_a.narrow(0, r, mla.kv_a.dim(0)? - r)?,
    );
    let (l_w, l_b) = (latent.narrow(1, 0, c)?, latent.narrow(1, c, 1)?);
    let frobenius = l_w.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
    let bias = l_b.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
    let anchor = Anchor::new(frobenius * x_bound + bias, r);
    let a_row = Tensor::zeros((1, c + 1), DType::F64, cpu)?;
    let a_row = a_row.slice_assign(&[0..1, c..c + 1], &Tensor::new(&[[anchor.a]], cpu)?)?;
    let kv_a = Tensor::cat(&[&latent, &a_row, &rope], 0)?; // (R + W, C + 1)
    out.push((
        "kv_a_proj_with_mqa.weight".into(),
        f32(kv_a.narrow(1, 0, c)?)?,
    ));
    out.push((
        "kv_a_proj_with_mqa.bias".into(),
        f32(kv_a.narrow(1, c, 1)?.squeeze(1)?)?,
    ));
    out.push(("kv_a_layernorm.weight".into(), anchor.norm_weight(r)?));
    // 3. kv_b reads the normalised latent (u · scale); the anchor's column is zero (the
    //    latent's own bias is inside u).
    let kv_b = &mla.kv_b;
    let zero = Tensor::zeros((kv_b.dim(0)?, 1), DType::F64, cpu)?;
    let kv_b = Tensor::cat(&[(kv_b / anchor.scale)?, zero], 1)?;
    out.push(("kv_b_proj.weight".into(), f32(kv_b)?));
    Ok(out)
}
