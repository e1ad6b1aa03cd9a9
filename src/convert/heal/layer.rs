//! The layer-wise fit: one converted attention towards the original's output on that
//! layer's calibration windows (see the module above for the method).

use super::attend::{attend, in_batches, mask, output, Form};
use super::{batch, Fit, Geometry};
use crate::convert::gqa::Projections;
use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use nalgebra::DMatrix;

/// AdamW's learning rate, without weight decay (the fit starts where the conversion put
/// it and should stay near it).
const LR: f64 = 1e-3;

/// Fits `form` so that its output on `inputs` (N, T, C + 1), f32, is the output of
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
    let (n, t, _) = inputs.dims3()?;
    if n < 2 {
        return Err(Error::Invalid(format!(
            "--heal: the calibration text gives {n} window(s) of {t} tokens; healing \
             needs at least 2 (one to fit, one to check)"
        )));
    }
    let held = (n / 4).max(1);
    let reference = (Form::Gqa {
        q: original.q.clone(),
        k: original.k.clone(),
        v: original.v.clone(),
        o: original.o.clone(),
    })
    .to(DType::F32, &geo.device)?;
    let mask = mask(t, &geo.device)?;
    let targets = in_batches(inputs, |x| output(&reference, x, geo, &mask))?;
    let fit_set = Set::new(inputs, &targets, 0, n - held)?;
    let check = Set::new(inputs, &targets, n - held, held)?;
    let start = form.to(DType::F32, &geo.device)?;
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
    let (m, b) = (fit_set.inputs.dim(0)?, batch(t));
    for step in 0..steps {
        let picks: Vec<u32> = (0..b.min(m)).map(|i| ((step * b + i) % m) as u32).collect();
        let picks = Tensor::new(picks.as_slice(), &geo.device)?;
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
    Ok((kept.to(DType::F64, &Device::Cpu)?, Fit { before, after }))
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
        let candidate = f.with_o(Tensor::from_vec(o, (c, width), &geo.device)?);
        let e = check.error(&candidate, geo, mask)?;
        if e < best.0 {
            best = (e, candidate);
        }
    }
    Ok(best.1)
}
