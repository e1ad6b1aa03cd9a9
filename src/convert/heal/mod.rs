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
mod layer;
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
use candle_core::{DType, Device, Tensor};
pub use layer::heal;
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
        // RoPE for the windows' own length (the model's context where shorter: `window`).
        let t = windows.first().map_or(Ok(0), |w| w.dim(1))?;
        let positions: Vec<u32> = (0..t as u32).collect();
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
