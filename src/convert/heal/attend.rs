//! Attention once more, in candle's differentiable basic ops, for fitting only: GQA over
//! windows that start at position 0, whose keys and values come either from their own
//! projections (`gqa:G`, `mqa`) or from one latent (`lowrank:R`: k = U_k·D·x̃,
//! v = U_v·D·x̃), as the engine runs them (`model::attention`).

use super::{Geometry, BATCH};
use crate::error::Result;
use candle_core::{DType, Device, Tensor, D};

/// One converted layer's attention in the form healing fits, in f64 like the conversions:
/// projections (rows, C + 1) with their bias as the last column, `o` (C, H·D).
#[derive(Debug, Clone)]
pub enum Form {
    /// K/V heads with projections of their own.
    Gqa {
        q: Tensor,
        k: Tensor,
        v: Tensor,
        o: Tensor,
    },
    /// Keys and values rebuilt from one latent: `down` (R, C + 1), `k_up`/`v_up` (G·D, R).
    LowRank {
        q: Tensor,
        down: Tensor,
        k_up: Tensor,
        v_up: Tensor,
        o: Tensor,
    },
}

impl Form {
    pub(super) fn tensors(&self) -> Vec<&Tensor> {
        match self {
            Form::Gqa { q, k, v, o } => vec![q, k, v, o],
            Form::LowRank {
                q,
                down,
                k_up,
                v_up,
                o,
            } => vec![q, down, k_up, v_up, o],
        }
    }

    /// The same form with `ts` (in [`Self::tensors`]' order) in place of its tensors.
    pub(super) fn with(&self, ts: &[Tensor]) -> Self {
        match self {
            Form::Gqa { .. } => Form::Gqa {
                q: ts[0].clone(),
                k: ts[1].clone(),
                v: ts[2].clone(),
                o: ts[3].clone(),
            },
            Form::LowRank { .. } => Form::LowRank {
                q: ts[0].clone(),
                down: ts[1].clone(),
                k_up: ts[2].clone(),
                v_up: ts[3].clone(),
                o: ts[4].clone(),
            },
        }
    }

    /// The same form with every tensor in `dtype` on `device`.
    pub(super) fn to(&self, dtype: DType, device: &Device) -> Result<Self> {
        let ts = self
            .tensors()
            .into_iter()
            .map(|t| t.to_dtype(dtype)?.to_device(device))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(self.with(&ts))
    }

    pub(super) fn o(&self) -> &Tensor {
        match self {
            Form::Gqa { o, .. } | Form::LowRank { o, .. } => o,
        }
    }

    /// The same form with another output projection.
    pub(super) fn with_o(&self, o: Tensor) -> Self {
        let mut ts: Vec<Tensor> = self.tensors().into_iter().cloned().collect();
        let last = ts.len() - 1;
        ts[last] = o;
        self.with(&ts)
    }

    /// (q, k, v) as (rows, C + 1) projections.
    fn qkv(&self) -> Result<(Tensor, Tensor, Tensor)> {
        Ok(match self {
            Form::Gqa { q, k, v, .. } => (q.clone(), k.clone(), v.clone()),
            Form::LowRank {
                q,
                down,
                k_up,
                v_up,
                ..
            } => (q.clone(), k_up.matmul(down)?, v_up.matmul(down)?),
        })
    }
}

/// `f` over `inputs` a few windows at a time, the results joined along the first dim.
pub fn in_batches(inputs: &Tensor, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let n = inputs.dim(0)?;
    let parts = (0..n)
        .step_by(BATCH)
        .map(|i| f(&inputs.narrow(0, i, BATCH.min(n - i))?))
        .collect::<Result<Vec<_>>>()?;
    Ok(Tensor::cat(&parts, 0)?)
}

/// 0 on and below the diagonal, -∞ above: (T, T).
pub fn mask(t: usize, dev: &Device) -> Result<Tensor> {
    let m: Vec<f32> = (0..t * t)
        .map(|i| match i % t > i / t {
            true => f32::NEG_INFINITY,
            false => 0.0,
        })
        .collect();
    Ok(Tensor::from_vec(m, (t, t), dev)?)
}

/// The attention's output (B, T, C) for x (B, T, C + 1), before any `o_proj` bias.
pub fn output(f: &Form, x: &Tensor, geo: &Geometry, mask: &Tensor) -> Result<Tensor> {
    Ok(attend(f, x, geo, mask)?.broadcast_matmul(&f.o().t()?)?)
}

/// The heads' outputs before `o_proj`, (B, T, H·D), for x (B, T, C + 1): GQA attention with
/// RoPE over each window from position 0, in differentiable ops.
pub fn attend(f: &Form, x: &Tensor, geo: &Geometry, mask: &Tensor) -> Result<Tensor> {
    let (b, t, c1) = x.dims3()?;
    let (h, d) = (geo.num_heads, geo.head_dim);
    let (wq, wk, wv) = f.qkv()?;
    let g = wk.dim(0)? / d;
    let flat = x.reshape((b * t, c1))?;
    let proj = |w: &Tensor, n: usize| -> candle_core::Result<Tensor> {
        flat.matmul(&w.t()?)?
            .reshape((b, t, n, d))?
            .transpose(1, 2)?
            .contiguous()
    };
    let q = geo.rotation.apply_differentiable(&proj(&wq, h)?)?;
    let k = geo.rotation.apply_differentiable(&proj(&wk, g)?)?;
    let v = proj(&wv, g)?;
    // The H/G query heads of a K/V head as one block of rows: no copies of K and V.
    let q = q.reshape((b, g, (h / g) * t, d))?;
    let mask = mask.repeat(((h / g), 1))?;
    let scores = (q.matmul(&k.t()?)? / (d as f64).sqrt())?.broadcast_add(&mask)?;
    // The row maxima only keep exp in range: no gradient flows through them.
    let max = scores.max_keepdim(D::Minus1)?.detach();
    let e = scores.broadcast_sub(&max)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    let y = p.matmul(&v)?.reshape((b, h, t, d))?.transpose(1, 2)?;
    Ok(y.reshape((b, t, h * d))?)
}
