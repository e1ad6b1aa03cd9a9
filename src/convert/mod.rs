//! Attention conversion (`--attention SPEC`): a checkpoint trained with one attention runs
//! with another. A converted attention is an ordinary `GqaAttention` with other weights and
//! another `num_key_value_heads`: the conversion rewrites the config and the attention
//! tensors before the model is built ([`crate::loader::Rewrite`]), so the forward path is
//! the one every model runs.
//!
//! Methods that fit to activations first run the original model over a calibration text
//! ([`calibrate`]); [`DEFAULT_CALIBRATION`] ships with the program. `convert` writes the
//! same rewritten tensors out as a Hugging Face directory ([`write`]).

pub mod calibrate;
pub mod gqa;
pub mod heal;
pub mod linalg;
pub mod lowrank;
pub mod mla;
pub mod plan;
pub mod spec;
mod write;

pub use plan::{Latent, Plan};
pub use spec::{Layout, Method, Spec};
pub use write::{write, Written};

use crate::config::{AttentionConfig, ModelConfig};
use crate::error::{Error, Result};
use crate::loader::{DTypeArg, Loaded, Source};
use crate::model::rope::Rope;
use calibrate::Moments;
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use gqa::{augment, Heads, Projections};
use heal::Form;
use std::collections::HashMap;
use std::time::Instant;

/// The calibration text used without `--calibration`: technical prose written for this
/// project (data/calibration.txt: how computers, networks, compilers, databases and
/// numerical methods work), unlike the literary texts the tests evaluate on.
pub const DEFAULT_CALIBRATION: &str = include_str!("../../data/calibration.txt");

/// A conversion asked for: the spec, the calibration text (`None`: the default), and
/// `--heal`'s optimiser steps per layer (`None`: no healing).
#[derive(Debug, Clone)]
pub struct Request {
    pub spec: Spec,
    pub calibration: Option<String>,
    pub heal: Option<usize>,
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
    pub heal: Option<HealReport>,
}

/// What `--heal` did: its time, and each layer's relative output error before and after.
#[derive(Debug, Clone)]
pub struct HealReport {
    pub secs: f64,
    pub steps: usize,
    pub tokens: usize,
    pub layers: Vec<heal::Fit>,
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
    /// Running the original over the calibration text (tokens).
    Calibrating,
    /// Healing the converted attention (layers).
    Healing,
    /// Writing the converted tensors (tensors).
    Converting,
}

/// A conversion done: the plan, and every converted layer's attention tensors.
/// [`Self::rewrite`] is the one place converted tensors come from, whether they are loaded
/// ([`load`]) or written out ([`write`]).
pub struct Conversion {
    plan: Plan,
    replaced: HashMap<String, Tensor>,
    calibration_tokens: usize,
    heal: Option<HealReport>,
    start: Instant,
}

impl Conversion {
    /// Plans `req` for `source`, runs the original model over the calibration text when
    /// the fit or healing needs it, and converts every layer's attention.
    pub fn prepare(
        source: &Source,
        req: &Request,
        mut progress: impl FnMut(Stage, usize, usize),
    ) -> Result<Self> {
        let start = Instant::now();
        let stored = source.stored()?;
        let cfg = stored.cfg;
        let plan = req.spec.plan(&cfg)?;
        let heads = heads(&cfg, &plan, req.heal.is_some())?;
        let aware = plan.method == Method::Aware && !plan.is_exact();
        let healing = req.heal.filter(|_| !plan.is_exact());
        let mut calibration = Calibration::default();
        if aware || healing.is_some() {
            calibration = calibrate(source, req, aware, healing.is_some(), &mut progress)?;
        }
        let moments = calibration.moments.as_ref();
        let replaced = fit(&plan, heads, &cfg, &*stored.backend, moments)?;
        let (replaced, heal) = match (healing, &calibration.windows) {
            (Some(steps), Some(windows)) => {
                let (r, h) = heal_all(
                    &plan,
                    &cfg,
                    replaced,
                    &*stored.backend,
                    windows,
                    steps,
                    |d, n| progress(Stage::Healing, d, n),
                )?;
                (r, Some(h))
            }
            _ => (replaced, None),
        };
        Ok(Self {
            plan,
            replaced,
            calibration_tokens: calibration.tokens,
            heal,
            start,
        })
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The converted config, and `backend` with every layer's attention projections
    /// replaced (the [`crate::loader::Rewrite`] door).
    pub fn rewrite(
        &self,
        cfg: &ModelConfig,
        backend: Box<dyn SimpleBackend>,
    ) -> Result<(ModelConfig, Box<dyn SimpleBackend>)> {
        let inner = Replaced {
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
            heal: self.heal.clone(),
        }
    }
}

/// Loads `source` with its attention converted as `req` asks, at `dtype` on `device`.
/// `progress(stage, done, total)` follows calibration and healing.
pub fn load(
    source: &Source,
    dtype: DTypeArg,
    device: &Device,
    req: &Request,
    progress: impl FnMut(Stage, usize, usize),
) -> Result<(Loaded, Report)> {
    let conversion = Conversion::prepare(source, req, progress)?;
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
    if lossy && heal && (qk_norm || plan.latent.is_some_and(|l| l.rope.is_some())) {
        return Err(Error::Invalid(format!(
            "--heal: heals gqa:G, mqa and lowrank:R conversions of models without q/k norms, \
             not --attention {}{}",
            plan.spec,
            if qk_norm {
                " of a model with q/k norms"
            } else {
                ""
            }
        )));
    }
    Ok(Heads {
        d: head_dim,
        interleaved: cfg.rope.interleaved,
    })
}

/// What the original model gave on the calibration text.
#[derive(Default)]
struct Calibration {
    moments: Option<Moments>,
    windows: Option<Vec<Tensor>>,
    tokens: usize,
}

/// The original model in f32 over the calibration text: each layer's input moments (for
/// `aware`) and input windows (for `--heal`).
fn calibrate(
    source: &Source,
    req: &Request,
    moments: bool,
    windows: bool,
    progress: &mut impl FnMut(Stage, usize, usize),
) -> Result<Calibration> {
    let original = source.load(DTypeArg::Fixed(DType::F32), &Device::Cpu)?;
    let text = req.calibration.as_deref().unwrap_or(DEFAULT_CALIBRATION);
    let tokenizer = original.tokenizer.as_ref().ok_or_else(|| {
        Error::Invalid(
            "--attention: method=aware and --heal need the model's tokenizer.json".into(),
        )
    })?;
    let ids = tokenizer.encode(text)?;
    let mut out = Calibration {
        tokens: ids.len(),
        ..Default::default()
    };
    if moments {
        let m = calibrate::measure(&original.model, &ids, |done| {
            progress(Stage::Calibrating, done, ids.len())
        })?;
        out.moments = Some(m);
    }
    if windows {
        let (window, count) = (heal::WINDOW, heal::WINDOWS);
        let w = calibrate::windows(&original.model, &ids, window, count, |done, n| {
            progress(Stage::Calibrating, done * window, n * window)
        })?;
        out.windows = Some(w);
    }
    Ok(out)
}

/// One layer's original attention projections, augmented, in f64.
fn projections(
    backend: &dyn SimpleBackend,
    cfg: &ModelConfig,
    layer: usize,
) -> Result<Projections> {
    let AttentionConfig::Gqa { qkv_bias, .. } = cfg.attention else {
        return Err(Error::Invalid("--attention: not a GQA-family model".into()));
    };
    let name = |p: &str, what: &str| format!("model.layers.{layer}.self_attn.{p}.{what}");
    let get = |p: &str, what: &str| backend.get_unchecked(&name(p, what), DType::F32, &Device::Cpu);
    let proj = |p: &str| -> Result<Tensor> {
        let bias = match qkv_bias {
            true => Some(get(p, "bias")?),
            false => None,
        };
        augment(&get(p, "weight")?, bias.as_ref())
    };
    Ok(Projections {
        q: proj("q_proj")?,
        k: proj("k_proj")?,
        v: proj("v_proj")?,
        o: get("o_proj", "weight")?.to_dtype(DType::F64)?,
    })
}

/// Every layer's converted attention tensors, by checkpoint name, f32.
fn fit(
    plan: &Plan,
    heads: Heads,
    cfg: &ModelConfig,
    backend: &dyn SimpleBackend,
    moments: Option<&Moments>,
) -> Result<HashMap<String, Tensor>> {
    let mut replaced = HashMap::new();
    for layer in 0..cfg.num_hidden_layers {
        let w = projections(backend, cfg, layer)?;
        let moment = moments.map(|m| &m.per_layer[layer]);
        let form = if plan.latent.is_some_and(|l| l.rope.is_some()) {
            let out = mla::convert(plan, heads, &w, moment)?;
            let c = cfg.hidden_size;
            let weight = |t: &Tensor| t.narrow(1, 0, c)?.to_dtype(DType::F32);
            let name = |p: &str| format!("model.layers.{layer}.self_attn.{p}.weight");
            replaced.insert(name("q_proj"), weight(&out.q)?);
            replaced.insert(name("kv_a_proj_with_mqa"), weight(&out.kv_a)?);
            replaced.insert(name("kv_b_proj"), out.kv_b.to_dtype(DType::F32)?);
            continue;
        } else if plan.latent.is_some() {
            let out = lowrank::convert(plan, heads, &w, moment)?;
            Form::LowRank {
                q: w.q,
                down: out.down,
                k_up: out.k_up,
                v_up: out.v_up,
                o: w.o,
            }
        } else {
            let out = gqa::convert(plan, heads, &w, moment)?;
            Form::Gqa {
                q: out.q,
                k: out.k,
                v: out.v,
                o: out.o,
            }
        };
        put(&mut replaced, cfg, layer, &form)?;
    }
    Ok(replaced)
}

/// `form`'s tensors under their checkpoint names: an augmented (rows, C + 1) projection as
/// its weight and, where the model has them, its bias.
fn put(
    replaced: &mut HashMap<String, Tensor>,
    cfg: &ModelConfig,
    layer: usize,
    form: &Form,
) -> Result<()> {
    let AttentionConfig::Gqa { qkv_bias, .. } = cfg.attention else {
        return Err(Error::Invalid("--attention: not a GQA-family model".into()));
    };
    let c = cfg.hidden_size;
    let name = |p: &str, what: &str| format!("model.layers.{layer}.self_attn.{p}.{what}");
    let mut augmented = |p: &str, t: &Tensor| -> Result<()> {
        replaced.insert(name(p, "weight"), t.narrow(1, 0, c)?.to_dtype(DType::F32)?);
        if qkv_bias {
            let bias = t.narrow(1, c, 1)?.squeeze(1)?.to_dtype(DType::F32)?;
            replaced.insert(name(p, "bias"), bias);
        }
        Ok(())
    };
    let plain = match form {
        Form::Gqa { q, k, v, o } => {
            augmented("q_proj", q)?;
            augmented("k_proj", k)?;
            augmented("v_proj", v)?;
            vec![("o_proj", o)]
        }
        Form::LowRank {
            q,
            down,
            k_up,
            v_up,
            o,
        } => {
            augmented("q_proj", q)?;
            augmented("kv_down", down)?;
            vec![("k_up", k_up), ("v_up", v_up), ("o_proj", o)]
        }
    };
    for (p, t) in plain {
        replaced.insert(name(p, "weight"), t.to_dtype(DType::F32)?);
    }
    Ok(())
}

/// Heals every layer of a gqa/lowrank conversion ([`heal`]), `steps` optimiser steps each.
fn heal_all(
    plan: &Plan,
    cfg: &ModelConfig,
    mut replaced: HashMap<String, Tensor>,
    backend: &dyn SimpleBackend,
    windows: &[Tensor],
    steps: usize,
    mut progress: impl FnMut(usize, usize),
) -> Result<(HashMap<String, Tensor>, HealReport)> {
    let start = Instant::now();
    let AttentionConfig::Gqa { head_dim, .. } = cfg.attention else {
        return Err(Error::Invalid("--heal: not a GQA-family model".into()));
    };
    let window = windows.first().map_or(0, |w| w.dim(1).unwrap_or(0));
    let positions: Vec<u32> = (0..window as u32).collect();
    let geo = heal::Geometry {
        num_heads: cfg.num_attention_heads,
        head_dim,
        rotation: Rope::new(&cfg.rope, DType::F32, &Device::Cpu)?.at_positions(&positions)?,
    };
    let n = cfg.num_hidden_layers;
    let mut layers = Vec::with_capacity(n);
    for (layer, inputs) in windows.iter().enumerate() {
        let original = projections(backend, cfg, layer)?;
        let form = converted_form(plan, cfg, &replaced, layer)?;
        let (healed, fit) = heal::heal(&form, &original, inputs, &geo, steps)?;
        put(&mut replaced, cfg, layer, &healed)?;
        layers.push(fit);
        progress(layer + 1, n);
    }
    let report = HealReport {
        secs: start.elapsed().as_secs_f64(),
        steps,
        tokens: windows
            .first()
            .map_or(0, |w| w.dim(0).unwrap_or(0) * window),
        layers,
    };
    Ok((replaced, report))
}

/// A layer's converted tensors back in [`Form`] (augmented, f64).
fn converted_form(
    plan: &Plan,
    cfg: &ModelConfig,
    replaced: &HashMap<String, Tensor>,
    layer: usize,
) -> Result<Form> {
    let AttentionConfig::Gqa { qkv_bias, .. } = cfg.attention else {
        return Err(Error::Invalid("--heal: not a GQA-family model".into()));
    };
    let get = |p: &str, what: &str| -> Result<&Tensor> {
        let name = format!("model.layers.{layer}.self_attn.{p}.{what}");
        replaced
            .get(&name)
            .ok_or_else(|| Error::Invalid(format!("--heal: no converted {name}")))
    };
    let augmented = |p: &str| -> Result<Tensor> {
        let bias = match qkv_bias {
            true => Some(get(p, "bias")?.clone()),
            false => None,
        };
        augment(get(p, "weight")?, bias.as_ref())
    };
    let plain = |p: &str| -> Result<Tensor> { Ok(get(p, "weight")?.to_dtype(DType::F64)?) };
    Ok(match plan.latent {
        Some(_) => Form::LowRank {
            q: augmented("q_proj")?,
            down: augmented("kv_down")?,
            k_up: plain("k_up")?,
            v_up: plain("v_up")?,
            o: plain("o_proj")?,
        },
        None => Form::Gqa {
            q: augmented("q_proj")?,
            k: augmented("k_proj")?,
            v: augmented("v_proj")?,
            o: plain("o_proj")?,
        },
    })
}

/// The checkpoint's tensors, with some replaced by the conversion's (f32, on the CPU).
struct Replaced {
    inner: Box<dyn SimpleBackend>,
    replaced: HashMap<String, Tensor>,
}

impl SimpleBackend for Replaced {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        match self.replaced.get(name) {
            Some(t) if t.shape() != &s => Err(candle_core::Error::Msg(format!(
                "converted {name}: shape {:?}, the model expects {s:?}",
                t.shape()
            ))),
            Some(t) => t.to_dtype(dtype)?.to_device(dev),
            None => self.inner.get(s, name, h, dtype, dev),
        }
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        match self.replaced.get(name) {
            Some(t) => t.to_dtype(dtype)?.to_device(dev),
            None => self.inner.get_unchecked(name, dtype, dev),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.replaced.contains_key(name) || self.inner.contains_tensor(name)
    }
}
