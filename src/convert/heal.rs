//! `--heal`: after a lossy conversion, each layer's new attention is fitted to give the
//! original attention's output on the calibration text, layer by layer (as GPTQ calibrates,
//! not end-to-end training): the loss is the squared error of the attention's output (after
//! `o_proj`, before the residual add), relative to the output's energy, over windows of the
//! original model's own inputs to that layer ([`super::calibrate::windows`]).
//!
//! Per layer: the output projection first by least squares (it is linear in the heads'
//! outputs), then [`STEPS`] AdamW steps (candle-nn's) on every projection of the converted
//! form, then the output projection by least squares again. A fit that ends worse than it
//! began on the calibration windows is dropped, so healing never makes a layer worse there.
//!
//! The fit needs gradients, which candle's fused kernels (RoPE, softmax, the decode op) do
//! not give, so attention is written here once more in candle's differentiable basic ops,
//! for training only, in the layout the fit shares across conversions: GQA whose keys and
//! values come either from their own projections (`gqa:G`, `mqa`) or from one latent
//! (`lowrank:R`: k = U_k·D·x̃, v = U_v·D·x̃). A test checks it against the engine's forward.

use super::gqa::Projections;
use crate::error::{Error, Result};
use crate::model::rope::Rotation;
use candle_core::{DType, Device, Tensor, Var, D};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use nalgebra::DMatrix;

/// Tokens per calibration window: every window starts at position 0.
pub const WINDOW: usize = 256;
/// At most this many windows (8192 tokens) are kept per layer.
pub const WINDOWS: usize = 32;
/// Optimiser steps per layer without `--heal-steps`, and windows per step.
pub const STEPS: usize = 100;
const BATCH: usize = 4;
/// AdamW's learning rate, without weight decay (the fit starts where the conversion put
/// it and should stay near it).
const LR: f64 = 1e-3;

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

/// How a layer's fit went: the relative output error on the calibration windows.
#[derive(Debug, Clone, Copy)]
pub struct Fit {
    pub before: f64,
    pub after: f64,
}

/// The heads' shape and the windows' rotation and causal mask, shared by every layer.
pub struct Geometry {
    pub num_heads: usize,
    pub head_dim: usize,
    /// RoPE at positions 0..[`WINDOW`], f32.
    pub rotation: Rotation,
}

impl Form {
    fn tensors(&self) -> Vec<&Tensor> {
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
    fn with(&self, ts: &[Tensor]) -> Self {
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

    fn o(&self) -> &Tensor {
        match self {
            Form::Gqa { o, .. } | Form::LowRank { o, .. } => o,
        }
    }

    /// The same form with another output projection.
    fn with_o(&self, o: Tensor) -> Self {
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

/// Fits `form` so that its output on `inputs` (N, [`WINDOW`], C + 1), f32, is the output of
/// `original` there, with `steps` optimiser steps. The last quarter of the windows is held
/// out: it picks the least squares' regularisation, decides whether the fit is kept, and
/// gives the errors reported.
pub fn heal(
    form: &Form,
    original: &Projections,
    inputs: &Tensor,
    geo: &Geometry,
    steps: usize,
) -> Result<(Form, Fit)> {
    let n = inputs.dim(0)?;
    if n < 2 {
        return Err(Error::Invalid(format!(
            "--heal: the calibration text gives {n} window(s) of {WINDOW} tokens; healing \
             needs at least 2 (one to fit, one to check)"
        )));
    }
    let held = (n / 4).max(1);
    let f32_form = |f: &Form| -> Result<Form> {
        let ts = f
            .tensors()
            .into_iter()
            .map(|t| t.to_dtype(DType::F32))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(f.with(&ts))
    };
    let reference = f32_form(&Form::Gqa {
        q: original.q.clone(),
        k: original.k.clone(),
        v: original.v.clone(),
        o: original.o.clone(),
    })?;
    let mask = causal_mask(inputs.dim(1)?, inputs.device())?;
    let targets = in_batches(inputs, |x| output(&reference, x, geo, &mask))?;
    let fit_set = Set::new(inputs, &targets, 0, n - held)?;
    let check = Set::new(inputs, &targets, n - held, held)?;
    let start = f32_form(form)?;
    let before = check.error(&start, geo, &mask)?;
    // 1. The output projection by least squares, 2. AdamW on everything, 3. 1 again.
    let mut fitted = refit_o(&start, &fit_set, &check, geo, &mask)?;
    let vars = fitted
        .tensors()
        .into_iter()
        .map(Var::from_tensor)
        .collect::<candle_core::Result<Vec<_>>>()?;
    let params = ParamsAdamW {
        lr: LR,
        weight_decay: 0.0,
        ..Default::default()
    };
    let mut opt = AdamW::new(vars.clone(), params)?;
    let m = fit_set.inputs.dim(0)?;
    for step in 0..steps {
        let picks: Vec<u32> = (0..BATCH.min(m))
            .map(|i| ((step * BATCH + i) % m) as u32)
            .collect();
        let picks = Tensor::new(picks.as_slice(), inputs.device())?;
        let x = fit_set.inputs.index_select(&picks, 0)?;
        let y = fit_set.targets.index_select(&picks, 0)?;
        let current = fitted.with(
            &vars
                .iter()
                .map(|v| v.as_tensor().clone())
                .collect::<Vec<_>>(),
        );
        let out = output(&current, &x, geo, &mask)?;
        let loss = ((out - y)?.sqr()?.mean_all()? / fit_set.energy)?;
        opt.backward_step(&loss)?;
    }
    fitted = fitted.with(
        &vars
            .iter()
            .map(|v| v.as_tensor().detach())
            .collect::<Vec<_>>(),
    );
    fitted = refit_o(&fitted, &fit_set, &check, geo, &mask)?;
    let after = check.error(&fitted, geo, &mask)?;
    let (kept, after) = match after < before {
        true => (fitted, after),
        false => (start, before),
    };
    let ts = kept
        .tensors()
        .into_iter()
        .map(|t| t.to_dtype(DType::F64))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok((form.with(&ts), Fit { before, after }))
}

/// Some of the windows with the original's outputs on them.
struct Set {
    inputs: Tensor,
    targets: Tensor,
    /// The targets' mean square, which the errors are relative to.
    energy: f64,
}

impl Set {
    fn new(inputs: &Tensor, targets: &Tensor, start: usize, len: usize) -> Result<Self> {
        let targets = targets.narrow(0, start, len)?;
        let energy = targets.sqr()?.mean_all()?.to_scalar::<f32>()? as f64;
        Ok(Self {
            inputs: inputs.narrow(0, start, len)?,
            targets,
            energy,
        })
    }

    /// `f`'s mean squared error over these windows, relative to the targets' energy.
    fn error(&self, f: &Form, geo: &Geometry, mask: &Tensor) -> Result<f64> {
        let y = in_batches(&self.inputs, |x| output(f, x, geo, mask))?;
        let e = (y - &self.targets)?.sqr()?.mean_all()?.to_scalar::<f32>()? as f64;
        Ok(e / self.energy)
    }
}

/// `f` over `inputs` a few windows at a time, the results joined along the first dim.
fn in_batches(inputs: &Tensor, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let n = inputs.dim(0)?;
    let parts = (0..n)
        .step_by(BATCH)
        .map(|i| f(&inputs.narrow(0, i, BATCH.min(n - i))?))
        .collect::<Result<Vec<_>>>()?;
    Ok(Tensor::cat(&parts, 0)?)
}

/// 0 on and below the diagonal, -∞ above: (T, T).
fn causal_mask(t: usize, dev: &Device) -> Result<Tensor> {
    let m: Vec<f32> = (0..t * t)
        .map(|i| match i % t > i / t {
            true => f32::NEG_INFINITY,
            false => 0.0,
        })
        .collect();
    Ok(Tensor::from_vec(m, (t, t), dev)?)
}

/// The attention's output (B, T, C) for x (B, T, C + 1), before any `o_proj` bias.
fn output(f: &Form, x: &Tensor, geo: &Geometry, mask: &Tensor) -> Result<Tensor> {
    Ok(attend(f, x, geo, mask)?.broadcast_matmul(&f.o().t()?)?)
}

/// The heads' outputs before `o_proj`, (B, T, H·D), for x (B, T, C + 1): GQA attention with
/// RoPE over each window from position 0, in differentiable ops.
fn attend(f: &Form, x: &Tensor, geo: &Geometry, mask: &Tensor) -> Result<Tensor> {
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

/// `f` with its output projection refitted by least squares on `fit`, pulled towards the
/// current one: o = argmin ‖A·oᵀ − Y‖² + λ‖o − o₀‖² for A the heads' outputs, with λ (a
/// multiple of AᵀA's mean diagonal) the best on `check`, o₀ itself when none helps there.
/// Without the pull the least squares chase the calibration text: an MQA layer's heads all
/// read the same values, so their outputs are near collinear and an unregularised o
/// cancels large terms that do not cancel on other text.
fn refit_o(f: &Form, fit: &Set, check: &Set, geo: &Geometry, mask: &Tensor) -> Result<Form> {
    let heads = in_batches(&fit.inputs, |x| attend(f, x, geo, mask))?;
    let width = heads.dim(2)?;
    let a = heads.reshape(((), width))?.to_dtype(DType::F64)?;
    let y = fit
        .targets
        .reshape(((), fit.targets.dim(2)?))?
        .to_dtype(DType::F64)?;
    let ata = a.t()?.matmul(&a)?.flatten_all()?.to_vec1::<f64>()?;
    let aty = a.t()?.matmul(&y)?; // (H·D, C)
    let c = aty.dim(1)?;
    let aty = aty.flatten_all()?.to_vec1::<f64>()?;
    let o0 = f
        .o()
        .to_dtype(DType::F64)?
        .t()?
        .flatten_all()?
        .to_vec1::<f64>()?; // oᵀ, (H·D, C)
    let scale = (0..width).map(|i| ata[i * width + i]).sum::<f64>() / width as f64;
    let mut best = (check.error(f, geo, mask)?, f.clone());
    for ratio in [1e-3, 1e-2, 1e-1, 1.0] {
        let lambda = ratio * scale;
        let m = DMatrix::from_fn(width, width, |i, j| {
            ata[i * width + j] + if i == j { lambda } else { 0.0 }
        });
        let rhs = DMatrix::from_fn(width, c, |i, j| aty[i * c + j] + lambda * o0[i * c + j]);
        let Some(chol) = m.cholesky() else { continue };
        let sol = chol.solve(&rhs); // oᵀ
        let o: Vec<f32> = (0..c * width)
            .map(|k| sol[(k % width, k / width)] as f32)
            .collect();
        let candidate = f.with_o(Tensor::from_vec(o, (c, width), &Device::Cpu)?);
        let e = check.error(&candidate, geo, mask)?;
        if e < best.0 {
            best = (e, candidate);
        }
    }
    Ok(best.1)
}
