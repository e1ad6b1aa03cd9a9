//! `--heal`'s second part, end to end: after the layer-wise fit, every converted layer's
//! attention is trained at once so that the converted model's next-token distribution
//! matches the original's on the calibration windows (distillation, as TransMLA and
//! X-EcoMLA recover a conversion's loss), everything else frozen. Errors that add up
//! through the layers, which the layer-wise fit never sees, are what this aims at.
//!
//! The original's distribution is kept as its most probable next tokens per position and
//! the rest of the vocabulary as one outcome ([`Targets`]): the loss is its cross-entropy
//! against the converted model's distribution grouped the same way (the KL divergence up
//! to a constant). The converted
//! model runs once more in candle's differentiable basic ops ([`Frozen`]), the
//! attention through [`super::attend`]. The last [`HELD_OUT`]th of the windows is held
//! out: it is scored before training and every [`CHECK_EVERY`] steps, and the best state
//! it saw is what is kept (the layer-wise result when nothing beats it).

use super::attend::{mask, Form};
use super::frozen::Frozen;
use super::targets::Targets;
use super::{batch, Geometry};
use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use std::time::Instant;

/// One window in this many is held out (at least one, at most [`HELD_OUT_MAX`]).
const HELD_OUT: usize = 8;
const HELD_OUT_MAX: usize = 4;
/// Steps between checks on the held-out windows.
const CHECK_EVERY: usize = 10;
/// At a check that scores worse than the best state so far, training goes back to that
/// state and on at this fraction of its learning rate, with fresh moments. (SmolLM2's
/// `mla:192,rope=64` on its own text: every check at 1e-4 scored worse than the layer-wise
/// fit, while 3e-5 improved on it: +0.070 nats on the passage against +0.093.)
const BACKOFF: f64 = 0.3;
/// What the end-to-end training did: held-out loss (nats per position, the original's
/// top-K cross-entropy) before and after, and its cost.
#[derive(Debug, Clone, Copy)]
pub struct Distilled {
    pub steps: usize,
    /// The learning rate at the first step.
    pub lr: f64,
    pub tokens: usize,
    pub secs: f64,
    pub before: f64,
    pub after: f64,
}

/// Trains every layer's `forms` (f64 on the CPU, as the layer-wise fit leaves them) together
/// towards `targets` for `steps` AdamW steps (without weight decay) at learning rate `lr`
/// decaying linearly to a tenth, on `geo`'s device; `progress(done, steps)` after each.
/// Returns the forms the held-out windows liked best, in f64 on the CPU.
pub fn distil(
    frozen: &Frozen,
    forms: Vec<Form>,
    targets: &Targets,
    geo: &Geometry,
    (steps, lr): (usize, f64),
    mut progress: impl FnMut(usize, usize),
) -> Result<(Vec<Form>, Distilled)> {
    let start = Instant::now();
    if !(lr.is_finite() && lr > 0.0) {
        return Err(Error::Invalid(format!(
            "--heal-lr {lr}: give a finite learning rate above 0"
        )));
    }
    let (n, t) = (targets.windows(), targets.window());
    if n < 2 {
        return Err(Error::Invalid(format!(
            "--heal: the calibration text gives {n} window(s) of {t} tokens; healing \
             end to end needs at least 2 (one to fit, one to check)"
        )));
    }
    let held = (n / HELD_OUT).clamp(1, HELD_OUT_MAX);
    let (fit, check): (Vec<usize>, Vec<usize>) = ((0..n - held).collect(), (n - held..n).collect());
    let mask = mask(t, &geo.device)?;
    let per_step = batch(t);
    let f32_forms = forms
        .iter()
        .map(|f| f.to(DType::F32, &geo.device))
        .collect::<Result<Vec<_>>>()?;
    let vars: Vec<Vec<Var>> = f32_forms
        .iter()
        .map(|f| f.tensors().into_iter().map(Var::from_tensor).collect())
        .collect::<candle_core::Result<_>>()?;
    let current = |detach: bool| -> Vec<Form> {
        f32_forms
            .iter()
            .zip(&vars)
            .map(|(f, vs)| {
                let ts: Vec<Tensor> = vs
                    .iter()
                    .map(|v| match detach {
                        true => v.as_tensor().detach(),
                        false => v.as_tensor().clone(),
                    })
                    .collect();
                f.with(&ts)
            })
            .collect()
    };
    let before = frozen.score(&f32_forms, targets, &check, geo, &mask)?;
    let mut best = (before, snapshot(&f32_forms)?);
    let params = ParamsAdamW {
        lr,
        weight_decay: 0.0,
        ..Default::default()
    };
    let adamw = || AdamW::new(vars.iter().flatten().cloned().collect(), params.clone());
    let (mut opt, mut scale) = (adamw()?, 1.0);
    for step in 0..steps {
        opt.set_learning_rate(scale * lr * (1.0 - 0.9 * step as f64 / steps as f64));
        let picks: Vec<usize> = (0..per_step.min(fit.len()))
            .map(|i| fit[(step * per_step + i) % fit.len()])
            .collect();
        let loss = frozen.loss(
            &current(false),
            &targets.batch(&picks, &geo.device)?,
            geo,
            &mask,
        )?;
        opt.backward_step(&loss)?;
        if (step + 1) % CHECK_EVERY == 0 || step + 1 == steps {
            let now = current(true);
            let score = frozen.score(&now, targets, &check, geo, &mask)?;
            if score < best.0 {
                best = (score, snapshot(&now)?);
            } else if step + 1 < steps {
                for (vs, f) in vars.iter().zip(&best.1) {
                    for (v, t) in vs.iter().zip(f.tensors()) {
                        v.set(t)?;
                    }
                }
                (opt, scale) = (adamw()?, scale * BACKOFF);
            }
        }
        progress(step + 1, steps);
    }
    let healed = best
        .1
        .iter()
        .map(|f| f.to(DType::F64, &Device::Cpu))
        .collect::<Result<Vec<_>>>()?;
    let report = Distilled {
        steps,
        lr,
        tokens: fit.len() * t,
        secs: start.elapsed().as_secs_f64(),
        before,
        after: best.0,
    };
    Ok((healed, report))
}

/// A copy of `forms` that training leaves alone: a detached tensor still shares its
/// variable's storage, which every optimiser step overwrites in place.
fn snapshot(forms: &[Form]) -> Result<Vec<Form>> {
    forms
        .iter()
        .map(|f| {
            let ts = f.tensors().into_iter().map(Tensor::copy);
            Ok(f.with(&ts.collect::<candle_core::Result<Vec<_>>>()?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The best state kept is a copy: setting the variables (as a step does) leaves it,
    /// where a detached view of them would follow.
    #[test]
    fn a_kept_state_does_not_follow_the_variables() -> Result<()> {
        let cpu = &Device::Cpu;
        let vars: Vec<Var> = (0..4)
            .map(|i| Var::from_tensor(&Tensor::full(i as f32, (2, 2), cpu)?))
            .collect::<candle_core::Result<_>>()?;
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().detach()).collect();
        let view = Form::Gqa {
            q: ts[0].clone(),
            k: ts[1].clone(),
            v: ts[2].clone(),
            o: ts[3].clone(),
        };
        let kept = snapshot(std::slice::from_ref(&view))?;
        for v in &vars {
            v.set(&Tensor::full(9f32, (2, 2), cpu)?)?;
        }
        let first =
            |f: &Form| -> Result<f32> { Ok(f.tensors()[1].flatten_all()?.to_vec1::<f32>()?[0]) };
        assert_eq!(first(&kept[0])?, 1.0);
        assert_eq!(first(&view)?, 9.0, "a detached view follows its variable");
        Ok(())
    }
}
