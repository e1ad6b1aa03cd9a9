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
pub mod linalg;
pub mod lowrank;
pub mod mla;
pub mod plan;
pub mod spec;
mod write;

pub use plan::{Latent, Plan};
pub use spec::{Layout, Method, Spec};
pub use write::{write, Stage, Written};

use crate::config::{AttentionConfig, ModelConfig};
use crate::error::{Error, Result};
use crate::loader::{DTypeArg, Loaded, Source};
use calibrate::Moments;
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use gqa::{augment, Heads, Projections};
use std::collections::HashMap;
use std::time::Instant;

/// The calibration text used without `--calibration`: technical prose written for this
/// project (data/calibration.txt: how computers, networks, compilers, databases and
/// numerical methods work), unlike the literary texts the tests evaluate on.
pub const DEFAULT_CALIBRATION: &str = include_str!("../../data/calibration.txt");

/// A conversion asked for: the spec and the calibration text (`None`: the default).
#[derive(Debug, Clone)]
pub struct Request {
    pub spec: Spec,
    pub calibration: Option<String>,
}

/// What a conversion did, for the reports.
#[derive(Debug, Clone)]
pub struct Report {
    pub plan: Plan,
    /// Wall time of the whole conversion: calibration, fitting and building the model.
    pub secs: f64,
    /// Tokens of calibration text read (0 when the method needs none).
    pub calibration_tokens: usize,
}

/// A conversion ready to apply: the plan, and what the fit measured on the calibration
/// text. [`Self::rewrite`] is the one place converted tensors come from, whether they are
/// loaded ([`load`]) or written out ([`write`]).
pub struct Conversion {
    plan: Plan,
    heads: Heads,
    moments: Option<Moments>,
    start: Instant,
}

impl Conversion {
    /// Plans `req` for `source` and, for a lossy activation-aware fit, runs the original
    /// model over the calibration text. `progress(done, total)` follows its tokens.
    pub fn prepare(
        source: &Source,
        req: &Request,
        progress: impl FnMut(usize, usize),
    ) -> Result<Self> {
        let start = Instant::now();
        let cfg = source
            .describe(DTypeArg::Fixed(DType::F32), &Device::Cpu)?
            .cfg;
        let plan = req.spec.plan(&cfg)?;
        let heads = heads(&cfg, &plan)?;
        let moments = match plan.method == Method::Aware && !plan.is_exact() {
            true => Some(measure(source, req, progress)?),
            false => None,
        };
        Ok(Self {
            plan,
            heads,
            moments,
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
        rewrite(&self.plan, self.heads, cfg, backend, self.moments.as_ref())
    }

    /// What was done, timed from [`Self::prepare`] to now.
    pub fn report(&self) -> Report {
        Report {
            plan: self.plan,
            secs: self.start.elapsed().as_secs_f64(),
            calibration_tokens: self.moments.as_ref().map_or(0, |m| m.tokens),
        }
    }
}

/// Loads `source` with its attention converted as `req` asks, at `dtype` on `device`.
/// `progress(done, total)` follows the calibration's tokens.
pub fn load(
    source: &Source,
    dtype: DTypeArg,
    device: &Device,
    req: &Request,
    progress: impl FnMut(usize, usize),
) -> Result<(Loaded, Report)> {
    let conversion = Conversion::prepare(source, req, progress)?;
    let rewrite = |cfg: &ModelConfig, backend| conversion.rewrite(cfg, backend);
    let loaded = source.load_with(dtype, device, Some(&rewrite))?;
    Ok((loaded, conversion.report()))
}

/// The heads' shape, refusing what the aware fit cannot express.
fn heads(cfg: &ModelConfig, plan: &Plan) -> Result<Heads> {
    let AttentionConfig::Gqa { head_dim, .. } = cfg.attention else {
        return Err(Error::Invalid("--attention: not a GQA-family model".into()));
    };
    if plan.method == Method::Aware && !plan.is_exact() && cfg.rope.dim != head_dim {
        return Err(Error::Invalid(format!(
            "--attention {}: method=aware needs RoPE over the whole head (rotary dim {} of \
             head_dim {head_dim}); use method=mean",
            plan.spec, cfg.rope.dim
        )));
    }
    Ok(Heads {
        d: head_dim,
        interleaved: cfg.rope.interleaved,
    })
}

/// The original model in f32 over the calibration text: each layer's input moments.
fn measure(
    source: &Source,
    req: &Request,
    mut progress: impl FnMut(usize, usize),
) -> Result<Moments> {
    let original = source.load(DTypeArg::Fixed(DType::F32), &Device::Cpu)?;
    let text = req.calibration.as_deref().unwrap_or(DEFAULT_CALIBRATION);
    let tokenizer = original.tokenizer.as_ref().ok_or_else(|| {
        Error::Invalid("--attention: method=aware needs the model's tokenizer.json".into())
    })?;
    let ids = tokenizer.encode(text)?;
    calibrate::measure(&original.model, &ids, |done| progress(done, ids.len()))
}

/// The converted config, and the checkpoint's tensors with every layer's attention
/// projections replaced.
fn rewrite(
    plan: &Plan,
    heads: Heads,
    cfg: &ModelConfig,
    backend: Box<dyn SimpleBackend>,
    moments: Option<&Moments>,
) -> Result<(ModelConfig, Box<dyn SimpleBackend>)> {
    let AttentionConfig::Gqa { qkv_bias, .. } = cfg.attention else {
        return Err(Error::Invalid("--attention: not a GQA-family model".into()));
    };
    let mut replaced = HashMap::new();
    for layer in 0..cfg.num_hidden_layers {
        let name = |p: &str, what: &str| format!("model.layers.{layer}.self_attn.{p}.{what}");
        let get =
            |p: &str, what: &str| backend.get_unchecked(&name(p, what), DType::F32, &Device::Cpu);
        let proj = |p: &str| -> Result<Tensor> {
            let bias = match qkv_bias {
                true => Some(get(p, "bias")?),
                false => None,
            };
            augment(&get(p, "weight")?, bias.as_ref())
        };
        let w = Projections {
            q: proj("q_proj")?,
            k: proj("k_proj")?,
            v: proj("v_proj")?,
            o: get("o_proj", "weight")?.to_dtype(DType::F64)?,
        };
        let moment = moments.map(|m| &m.per_layer[layer]);
        let c = cfg.hidden_size;
        // An augmented (rows, C + 1) projection as its weight and, where the model has
        // them, its bias.
        let mut put = |p: &str, t: &Tensor| -> Result<()> {
            replaced.insert(name(p, "weight"), t.narrow(1, 0, c)?.to_dtype(DType::F32)?);
            if qkv_bias {
                let bias = t.narrow(1, c, 1)?.squeeze(1)?.to_dtype(DType::F32)?;
                replaced.insert(name(p, "bias"), bias);
            }
            Ok(())
        };
        if plan.latent.is_some_and(|l| l.rope.is_some()) {
            let out = mla::convert(plan, heads, &w, moment)?;
            let weight = |t: &Tensor| t.narrow(1, 0, c)?.to_dtype(DType::F32);
            replaced.insert(name("q_proj", "weight"), weight(&out.q)?);
            replaced.insert(name("kv_a_proj_with_mqa", "weight"), weight(&out.kv_a)?);
            replaced.insert(name("kv_b_proj", "weight"), out.kv_b.to_dtype(DType::F32)?);
            continue;
        }
        if plan.latent.is_some() {
            let out = lowrank::convert(plan, heads, &w, moment)?;
            put("kv_down", &out.down)?;
            for (p, t) in [("k_up", &out.k_up), ("v_up", &out.v_up)] {
                replaced.insert(name(p, "weight"), t.to_dtype(DType::F32)?);
            }
            continue;
        }
        let out = gqa::convert(plan, heads, &w, moment)?;
        for (p, t) in [("q_proj", &out.q), ("k_proj", &out.k), ("v_proj", &out.v)] {
            put(p, t)?;
        }
        replaced.insert(name("o_proj", "weight"), out.o.to_dtype(DType::F32)?);
    }
    let inner = Replaced {
        inner: backend,
        replaced,
    };
    Ok((plan.config(cfg), Box::new(inner)))
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
