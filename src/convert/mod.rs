//! Attention conversion (`--attention SPEC`): a checkpoint trained with one attention runs
//! with another. A converted attention is an ordinary `GqaAttention` with other weights and
//! another `num_key_value_heads`: the conversion rewrites the config and the attention
//! tensors before the model is built ([`crate::loader::Rewrite`]), so the forward path is
//! the one every model runs.
//!
//! Methods that fit to activations first run the original model over a calibration text
//! ([`calibrate`]); [`DEFAULT_CALIBRATION`] ships with the program. `convert` writes the
//! same rewritten tensors out as a Hugging Face directory ([`write`](fn@write)).

pub mod calibrate;
pub mod deepseek;
pub mod gqa;
pub mod heal;
pub mod linalg;
pub mod lowrank;
pub mod mla;
pub mod own_text;
pub mod plan;
pub mod rotation;
pub mod spec;
mod tensors;
mod write;

pub use plan::{Latent, Plan};
pub use spec::{Layout, Method, MlaLayout, Spec};
pub use write::{write, Written};

use crate::config::{AttentionConfig, ModelConfig};
use crate::error::{Error, Result};
use crate::loader::{DTypeArg, Loaded, Source, Stored};
use candle_core::{Device, Tensor};
use candle_nn::var_builder::SimpleBackend;
use gqa::Heads;
use std::collections::HashMap;
use std::time::Instant;

/// The calibration text used without `--calibration`: technical prose written for this
/// project (data/calibration.txt: how computers, networks, compilers, databases and
/// numerical methods work), unlike the literary texts the tests evaluate on.
pub const DEFAULT_CALIBRATION: &str = include_str!("../../data/calibration.txt");

/// A conversion asked for: the spec, the calibration text (`None`: the default), and
/// what `--heal` does (`None`: no healing).
#[derive(Debug, Clone)]
pub struct Request {
    pub spec: Spec,
    pub calibration: Option<String>,
    pub heal: Option<heal::Heal>,
}

/// What a conversion did, for the reports.
#[derive(Debug, Clone)]
pub struct Report {
    pub plan: Plan,
    /// Wall time of the whole conversion: calibration, fitting, healing and building the
    /// model.
    pub secs: f64,
    /// Tokens of calibration text read (0 when the method needs none).
    pub calibration_tokens: usize,
    /// Seconds spent getting the calibration text's tokens: the original writing its own,
    /// or tokenizing the one given.
    pub text_secs: f64,
    /// Seconds of the original's forwards over the calibration text (moments, the layers'
    /// inputs, its next-token distribution).
    pub calibration_secs: f64,
    pub heal: Option<HealReport>,
}

/// What `--heal` did: its time, and each layer's relative output error before and after.
#[derive(Debug, Clone)]
pub struct HealReport {
    pub secs: f64,
    pub steps: usize,
    pub tokens: usize,
    pub layers: Vec<heal::Fit>,
    /// The end-to-end training after the layer-wise fit, when there was one.
    pub end_to_end: Option<heal::Distilled>,
}

impl HealReport {
    /// The layers' mean relative output error (before, after).
    pub fn mean_error(&self) -> (f64, f64) {
        let n = self.layers.len().max(1) as f64;
        let sum = |f: fn(&heal::Fit) -> f64| self.layers.iter().map(f).sum::<f64>() / n;
        (sum(|l| l.before), sum(|l| l.after))
    }
}

/// What a conversion is doing, for a progress bar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// The original writing its own calibration text (tokens).
    Writing,
    /// Running the original over the calibration text (tokens).
    Calibrating,
    /// Healing the converted attention (layers).
    Healing,
    /// Training every converted layer together (steps).
    Distilling,
    /// Writing the converted tensors (tensors).
    Converting,
}

/// A conversion done: the plan, and every converted layer's attention tensors.
/// [`Self::rewrite`] is the one place converted tensors come from, whether they are loaded
/// ([`load`]) or written out ([`write`](fn@write)).
pub struct Conversion {
    plan: Plan,
    replaced: HashMap<String, Tensor>,
    calibration_tokens: usize,
    text_secs: f64,
    calibration_secs: f64,
    own_text: Option<String>,
    heal: Option<HealReport>,
    start: Instant,
}

impl Conversion {
    /// Plans `req` for `source` (whose files `stored` holds), runs the original model over
    /// the calibration text when the fit or healing needs it, and converts (and heals)
    /// every layer's attention. The original's forwards and the healing run on `device`;
    /// the fits' linear algebra on the CPU.
    pub fn prepare(
        source: &Source,
        stored: &Stored,
        req: &Request,
        device: &Device,
        mut progress: impl FnMut(Stage, usize, usize),
    ) -> Result<Self> {
        let start = Instant::now();
        let cfg = &stored.cfg;
        let plan = req.spec.plan(cfg)?;
        let heads = heads(cfg, &plan, req.heal.is_some())?;
        let aware = plan.method == Method::Aware && !plan.is_exact();
        let healing = req.heal.filter(|_| !plan.is_exact());
        let mut calibration = calibrate::Calibration::default();
        if aware || healing.is_some() {
            let turns = plan.turns();
            calibration =
                calibrate::run(source, req, aware, turns, healing, device, &mut progress)?;
        }
        let mut healer = match (healing, &calibration.windows) {
            (Some(h), Some(windows)) => {
                let whole = match &calibration.targets {
                    Some(targets) if h.steps > 0 => Some(heal::EndToEnd {
                        frozen: heal::Frozen::load(&*stored.backend, cfg, device)?,
                        targets,
                        steps: h.steps,
                        lr: h.lr,
                    }),
                    _ => None,
                };
                Some(heal::Healer::new(
                    cfg,
                    windows,
                    h.layer_steps,
                    whole,
                    device,
                )?)
            }
            _ => None,
        };
        let replaced = tensors::fit(
            &plan,
            heads,
            cfg,
            &*stored.backend,
            &calibration,
            healer.as_mut(),
            &mut progress,
        )?;
        Ok(Self {
            plan,
            replaced,
            calibration_tokens: calibration.tokens,
            text_secs: calibration.text_secs,
            calibration_secs: calibration.secs,
            own_text: calibration.own_text,
            heal: healer.map(heal::Healer::report),
            start,
        })
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The calibration text the original wrote itself for `--heal`, when it did.
    pub fn own_text(&self) -> Option<&str> {
        self.own_text.as_deref()
    }

    /// The names of the converted tensors that start with `prefix`, sorted.
    pub fn replaced_names(&self, prefix: &str) -> Vec<String> {
        let mut names: Vec<String> = (self.replaced.keys())
            .filter(|n| n.starts_with(prefix))
            .cloned()
            .collect();
        names.sort();
        names
    }

    /// The converted config, and `backend` with every layer's attention projections
    /// replaced (the [`crate::loader::Rewrite`] door).
    pub fn rewrite(
        &self,
        cfg: &ModelConfig,
        backend: Box<dyn SimpleBackend>,
    ) -> Result<(ModelConfig, Box<dyn SimpleBackend>)> {
        let inner = tensors::Replaced {
            inner: backend,
            replaced: self.replaced.clone(),
        };
        Ok((self.plan.config(cfg), Box::new(inner)))
    }

    /// What was done, timed from [`Self::prepare`] to now.
    pub fn report(&self) -> Report {
        Report {
            plan: self.plan,
            secs: self.start.elapsed().as_secs_f64(),
            calibration_tokens: self.calibration_tokens,
            text_secs: self.text_secs,
            calibration_secs: self.calibration_secs,
            heal: self.heal.clone(),
        }
    }
}

/// Loads `source` with its attention converted as `req` asks, at `dtype` on `device`
/// (where calibration and healing run too). `progress(stage, done, total)` follows them.
pub fn load(
    source: &Source,
    dtype: DTypeArg,
    device: &Device,
    req: &Request,
    progress: impl FnMut(Stage, usize, usize),
) -> Result<(Loaded, Report)> {
    let stored = source.stored()?;
    let conversion = Conversion::prepare(source, &stored, req, device, progress)?;
    let rewrite = |cfg: &ModelConfig, backend| conversion.rewrite(cfg, backend);
    let loaded = source.load_with(dtype, device, Some(&rewrite))?;
    Ok((loaded, conversion.report()))
}

/// The heads' shape, refusing what the aware fit and healing cannot express.
fn heads(cfg: &ModelConfig, plan: &Plan, heal: bool) -> Result<Heads> {
    let AttentionConfig::Gqa {
        head_dim, qk_norm, ..
    } = cfg.attention
    else {
        return Err(Error::Invalid("--attention: not a GQA-family model".into()));
    };
    let lossy = !plan.is_exact();
    if lossy && (plan.method == Method::Aware || heal) && cfg.rope.dim != head_dim {
        return Err(Error::Invalid(format!(
            "--attention {}: method=aware and --heal need RoPE over the whole head (rotary \
             dim {} of head_dim {head_dim}); use method=mean without --heal",
            plan.spec, cfg.rope.dim
        )));
    }
    if lossy && heal && qk_norm {
        return Err(Error::Invalid(format!(
            "--heal: heals conversions of models without q/k norms, not --attention {} of \
             a model with q/k norms (their fit would need the norms in every form)",
            plan.spec
        )));
    }
    Ok(Heads {
        d: head_dim,
        interleaved: cfg.rope.interleaved,
    })
}
