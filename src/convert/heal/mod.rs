//! `--heal`: after a lossy conversion, each layer's new attention is fitted to give the
//! original attention's output on the calibration text, layer by layer (as GPTQ calibrates;
//! [`distil`] then trains them all together, end to end): the loss is the squared error of
//! the attention's output (after `o_proj`, before the residual add), relative to the
//! output's energy, over windows of the
//! original model's own inputs to that layer ([`super::calibrate::windows`]).
//!
//! Per layer: the output projection first by least squares (it is linear in the heads'
//! outputs), then [`STEPS`] AdamW steps (candle-nn's) on every projection of the converted
//! form, then the output projection by least squares again. The last quarter of the
//! windows is held out: it picks the least squares' regularisation, and a fit that ends
//! worse there than it began is dropped.
//!
//! The fit needs gradients, which candle's fused kernels (RoPE, softmax, the decode op) do
//! not give, so attention is written once more, for fitting only, in `attend`.
//! MLA is fitted in its expanded form (per-head keys and values up-projected from the
//! latent), which the engine's absorbed decode is tested equal to.

mod attend;
pub mod distil;
mod frozen;
mod head_loss;
mod product;
pub mod targets;

pub use attend::{mask, weights, Form};
pub use distil::Distilled;
pub use frozen::Frozen;
pub use targets::Targets;

use super::gqa::Projections;
use super::HealReport;
use crate::config::{AttentionConfig, ModelConfig};
use crate::error::{Error, Result};
use crate::model::rope::{Rope, Rotation};
use attend::{attend, in_batches, output};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use nalgebra::DMatrix;
use std::time::Instant;

/// Tokens per calibration window (every window starts at position 0), or the model's
/// context where that is shorter ([`window`]). Healed on 256-token windows, SmolLM2
/// `mla:192,rope=64` had lost 0.036 nats on passage.txt read 256 tokens at a time and 0.058
/// read whole (578 tokens): what healing taught it held only where it was taught. On 512-token
/// windows, the same text: +0.041 whole (docs/conversion.md).
pub const WINDOW: usize = 512;
/// Tokens of each layer's inputs the layer-wise fit keeps, at most.
pub const FIT_TOKENS: usize = 8192;
/// Tokens per optimiser step, layer-wise and end to end (one window at least).
const STEP_TOKENS: usize = 1024;

/// The calibration windows' length for a model of `max_positions` positions.
pub fn window(max_positions: usize) -> usize {
    WINDOW.min(max_positions)
}

/// Windows per optimiser step (and per forward without gradients) for windows of `t` tokens.
fn batch(t: usize) -> usize {
    (STEP_TOKENS / t.max(1)).max(1)
}
/// Optimiser steps per layer without `--heal-steps`. (With 1 step and the end-to-end
/// training after it, SmolLM2's `mqa` scored better than with 100 alone, `lowrank:128`
/// worse: docs/conversion.md.)
pub const STEPS: usize = 100;
/// End-to-end optimiser steps without `--heal-e2e-steps`.
pub const E2E_STEPS: usize = 80;
/// The end-to-end training's learning rate without `--heal-lr` (AdamW's, at the start; it
/// decays linearly to a tenth), for the forms without a latent (`gqa:G`, `mqa`).
pub const E2E_LR: f64 = 3e-4;
/// The same for MLA and low-rank forms, whose latent's two factors move together: SmolLM2
/// `mla:64,rope=64`, the same text, scored +0.490 on passage.txt at 1e-4 against +0.637 at
/// 3e-4; `lowrank:128` kept nothing of its end-to-end training at 3e-4 and scored +0.238 at
/// 1e-4 (docs/conversion.md).
pub const E2E_LR_LATENT: f64 = 1e-4;

/// The end-to-end learning rate without `--heal-lr` for layers converted to `forms`.
pub fn default_lr(forms: &[Form]) -> f64 {
    let latent = |f: &Form| matches!(f, Form::Mla { .. } | Form::LowRank { .. });
    match forms.iter().any(latent) {
        true => E2E_LR_LATENT,
        false => E2E_LR,
    }
}
/// Tokens of its own text the original writes without `--heal-tokens`.
pub const TOKENS: usize = 32768;
/// AdamW's learning rate, without weight decay (the fit starts where the conversion put
/// it and should stay near it).
const LR: f64 = 1e-3;

/// How a layer's fit went: its relative output error on the held-out calibration windows.
#[derive(Debug, Clone, Copy)]
pub struct Fit {
    pub before: f64,
    pub after: f64,
}

/// The heads' shape and the windows' rotation, shared by every layer, and where the fits
/// run.
pub struct Geometry {
    pub num_heads: usize,
    pub head_dim: usize,
    /// RoPE at positions 0..[`window`], f32.
    pub rotation: Rotation,
    /// Whether the model's q/k/v projections have biases: without, the projections' bias
    /// columns stay zero (they would not be written).
    pub bias: bool,
    /// Where the fits run: the calibration windows', the rotation's and the frozen
    /// tensors' device; the forms come there in f32 and go back to the CPU in f64.
    pub device: Device,
}

/// What `--heal` does: optimiser steps per layer in the layer-wise fit, then steps of the
/// whole model's end-to-end training ([`distil`]; 0: none), on `tokens` of text the
/// original writes itself ([`crate::convert::own_text`]) when no calibration text is given.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Heal {
    pub layer_steps: usize,
    pub steps: usize,
    /// The end-to-end learning rate (finite, above 0); `None`: [`default_lr`].
    pub lr: Option<f64>,
    pub tokens: usize,
}

/// The end-to-end training's inputs: the frozen rest of the model and the original's
/// distribution over the calibration windows.
pub struct EndToEnd<'a> {
    pub frozen: Frozen,
    pub targets: &'a Targets,
    pub steps: usize,
    pub lr: Option<f64>,
}

/// Heals a conversion's layers one by one as they are converted ([`Self::layer`]), on each
/// layer's calibration windows, then all together ([`Self::end_to_end`]), and keeps what
/// each fit did for the report.
pub struct Healer<'a> {
    geo: Geometry,
    /// Each layer's attention inputs, (N, [`window`], C + 1).
    windows: &'a [Tensor],
    steps: usize,
    fits: Vec<Fit>,
    whole: Option<EndToEnd<'a>>,
    distilled: Option<Distilled>,
    start: Instant,
}

impl<'a> Healer<'a> {
    /// The fits run on `device`, where `windows` (and `whole`'s frozen tensors) are.
    pub fn new(
        cfg: &ModelConfig,
        windows: &'a [Tensor],
        steps: usize,
        whole: Option<EndToEnd<'a>>,
        device: &Device,
    ) -> Result<Self> {
        let AttentionConfig::Gqa {
            head_dim, qkv_bias, ..
        } = cfg.attention
        else {
            return Err(Error::Invalid("--heal: not a GQA-family model".into()));
        };
        let positions: Vec<u32> = (0..window(cfg.max_position_embeddings) as u32).collect();
        let geo = Geometry {
            num_heads: cfg.num_attention_heads,
            head_dim,
            rotation: Rope::new(&cfg.rope, DType::F32, device)?.at_positions(&positions)?,
            bias: qkv_bias,
            device: device.clone(),
        };
        Ok(Self {
            geo,
            windows,
            steps,
            fits: Vec::with_capacity(windows.len()),
            whole,
            distilled: None,
            start: Instant::now(),
        })
    }

    /// Every layer's healed `forms` trained together, when end-to-end training was asked
    /// for (`progress(step, steps)` follows it); else `forms` as they are.
    pub fn end_to_end(
        &mut self,
        forms: Vec<Form>,
        progress: impl FnMut(usize, usize),
    ) -> Result<Vec<Form>> {
        let Some(w) = &self.whole else {
            return Ok(forms);
        };
        let lr = w.lr.unwrap_or_else(|| default_lr(&forms));
        let (forms, report) = distil::distil(
            &w.frozen,
            forms,
            w.targets,
            &self.geo,
            (w.steps, lr),
            progress,
        )?;
        self.distilled = Some(report);
        Ok(forms)
    }

    /// Layer `layer`'s converted attention `form`, healed towards `original` (both in f64
    /// on the CPU, as the conversions leave them; so is the result).
    pub fn layer(&mut self, layer: usize, form: &Form, original: &Projections) -> Result<Form> {
        let inputs = self.windows.get(layer).ok_or_else(|| {
            Error::Invalid(format!("--heal: no calibration windows for layer {layer}"))
        })?;
        let (healed, fit) = heal(form, original, inputs, &self.geo, self.steps)?;
        self.fits.push(fit);
        Ok(healed)
    }

    /// What was done, timed from [`Self::new`].
    pub fn report(self) -> HealReport {
        HealReport {
            secs: self.start.elapsed().as_secs_f64(),
            steps: self.steps,
            tokens: self
                .windows
                .first()
                .map_or(0, |w| w.dims3().map_or(0, |(n, t, _)| n * t)),
            layers: self.fits,
            end_to_end: self.distilled,
        }
    }
}

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
