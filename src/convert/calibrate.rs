//! The original model over its calibration text ([`run`]: the text given, the shipped one,
//! or the text the original writes itself for `--heal`): one forward keeping of each layer
//! only the second moment of its attention's input (every activation-aware fit is computed
//! from these: keys, values and queries are linear in the input, so the text is read once),
//! and for `--heal` (and MLA's expected rotations) its input windows, and for `--heal` its
//! next-token targets.

use super::{heal, own_text, Request, Stage, DEFAULT_CALIBRATION};
use crate::error::{Error, Result};
use crate::loader::{DTypeArg, Source};
use crate::model::{Transformer, PREFILL_CHUNK};
use candle_core::{DType, Device, Tensor};
use std::time::Instant;

/// Windows longer than this restart the cache: calibration wants many inputs, not long
/// contexts, and attention over a long window costs more than the products.
const WINDOW: usize = 2048;

/// E[x̃ x̃ᵀ] per layer over the calibration tokens, x̃ the attention input with a constant 1
/// appended (so biases fit like weights): (C + 1, C + 1) in f64, on the CPU where the fits
/// read them.
pub struct Moments {
    pub per_layer: Vec<Tensor>,
    pub tokens: usize,
}

/// Runs `ids` through `model` in windows of `WINDOW` tokens and averages the moments.
/// Needs at least `hidden_size` tokens, or the moments are singular.
pub fn measure(
    model: &Transformer,
    ids: &[u32],
    mut progress: impl FnMut(usize),
) -> Result<Moments> {
    let cfg = model.config();
    let need = cfg.hidden_size;
    if ids.len() < need {
        return Err(Error::Invalid(format!(
            "--calibration: the text has {} tokens; this model needs at least {need} \
             (its hidden size) for method=aware: give a longer text, or use method=mean",
            ids.len()
        )));
    }
    let window = WINDOW.min(cfg.max_position_embeddings);
    let mut cache = model.new_cache(window)?;
    let mut sums: Vec<Option<Tensor>> = vec![None; cfg.num_hidden_layers];
    for (w, chunk) in ids.chunks(window).enumerate() {
        cache.reset();
        for part in chunk.chunks(PREFILL_CHUNK) {
            let mut add = |layer: usize, x: &Tensor| -> Result<()> {
                let x = x.squeeze(0)?.to_dtype(DType::F32)?; // (T, C)
                let ones = Tensor::ones((x.dim(0)?, 1), DType::F32, x.device())?;
                let x = Tensor::cat(&[&x, &ones], 1)?; // (T, C + 1)
                                                       // The chunk's product in f32 (a few hundred terms per entry), the running
                                                       // sum over the whole text in f64.
                let xtx = x.t()?.matmul(&x)?.to_dtype(DType::F64)?;
                sums[layer] = Some(match sums[layer].take() {
                    Some(s) => (s + xtx)?,
                    None => xtx,
                });
                Ok(())
            };
            model.visit_attention_inputs(part, &mut cache, &mut add)?;
        }
        progress((w * window + chunk.len()).min(ids.len()));
    }
    let n = ids.len() as f64;
    let per_layer = sums
        .into_iter()
        .map(|s| {
            let s = s.ok_or_else(|| Error::Invalid("no layer saw the text".into()))?;
            Ok((s / n)?.to_device(&Device::Cpu)?)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Moments {
        per_layer,
        tokens: ids.len(),
    })
}

/// Each layer's attention input over up to `count` windows of `window` tokens spread over
/// `ids`, every window from position 0: (N, window, C + 1) in f32 per layer, a constant 1
/// appended as in [`Moments`]. What `--heal` fits on ([`super::heal`]).
pub fn windows(
    model: &Transformer,
    ids: &[u32],
    window: usize,
    count: usize,
    mut progress: impl FnMut(usize, usize),
) -> Result<Vec<Tensor>> {
    let cfg = model.config();
    let available = ids.len() / window;
    if available == 0 {
        return Err(Error::Invalid(format!(
            "--heal: the calibration text has {} tokens; healing needs at least {window}",
            ids.len()
        )));
    }
    let n = available.min(count);
    let mut cache = model.new_cache(window)?;
    let mut per_layer: Vec<Vec<Tensor>> = vec![Vec::with_capacity(n); cfg.num_hidden_layers];
    for w in 0..n {
        // Spread over the text: window w of n starts at the (w·available/n)-th slot.
        let start = w * available / n * window;
        cache.reset();
        let mut keep = |layer: usize, x: &Tensor| -> Result<()> {
            let x = x.squeeze(0)?.to_dtype(DType::F32)?;
            let ones = Tensor::ones((x.dim(0)?, 1), DType::F32, x.device())?;
            per_layer[layer].push(Tensor::cat(&[&x, &ones], 1)?);
            Ok(())
        };
        model.visit_attention_inputs(&ids[start..start + window], &mut cache, &mut keep)?;
        progress(w + 1, n);
    }
    per_layer
        .into_iter()
        .map(|xs| Ok(Tensor::stack(&xs, 0)?))
        .collect()
}

/// What the original model gave on the calibration text.
#[derive(Default)]
pub(super) struct Calibration {
    pub(super) moments: Option<Moments>,
    pub(super) windows: Option<Vec<Tensor>>,
    /// The original's next-token distribution, for end-to-end healing.
    pub(super) targets: Option<heal::Targets>,
    pub(super) tokens: usize,
    /// Seconds spent getting the text's tokens (the original writing its own).
    pub(super) text_secs: f64,
    /// Seconds of the original's forwards over it.
    pub(super) secs: f64,
    /// The text the original wrote itself, when it did.
    pub(super) own_text: Option<String>,
}

/// The original model in f32 on `device` over the calibration text: each layer's input
/// moments (for `aware`) and input windows (for `--heal`, and with `turns` for MLA's
/// expected rotations, [`super::rotation`]).
pub(super) fn run(
    source: &Source,
    req: &Request,
    moments: bool,
    turns: bool,
    heal: Option<heal::Heal>,
    device: &Device,
    progress: &mut impl FnMut(Stage, usize, usize),
) -> Result<Calibration> {
    let original = source.load(DTypeArg::Fixed(DType::F32), device)?;
    let tokenizer = original.tokenizer.as_ref().ok_or_else(|| {
        Error::Invalid(
            "--attention: method=aware and --heal need the model's tokenizer.json".into(),
        )
    })?;
    let start = Instant::now();
    let mut own = None;
    let ids = match (&req.calibration, heal) {
        (Some(text), _) => tokenizer.encode(text)?,
        // Training end to end wants far more text than ships: the original writes it.
        (None, Some(h)) if h.steps > 0 => {
            let ids = own_text::write(&original, h.tokens, 0, |done, n| {
                progress(Stage::Writing, done, n)
            })?;
            let text = tokenizer.inner().decode(&ids, false);
            own = Some(text.map_err(|e| Error::Tokenizer(e.to_string()))?);
            ids
        }
        (None, _) => tokenizer.encode(DEFAULT_CALIBRATION)?,
    };
    let text_secs = start.elapsed().as_secs_f64();
    let mut out = Calibration {
        tokens: ids.len(),
        text_secs,
        own_text: own,
        ..Default::default()
    };
    if moments {
        let m = measure(&original.model, &ids, |done| {
            progress(Stage::Calibrating, done, ids.len())
        })?;
        out.moments = Some(m);
    }
    let window = heal::window(original.model.config().max_position_embeddings);
    if heal.is_some() || turns {
        let count = heal::FIT_TOKENS / window;
        let w = windows(&original.model, &ids, window, count, |done, n| {
            progress(Stage::Calibrating, done * window, n * window)
        })?;
        out.windows = Some(w);
    }
    if heal.is_some_and(|h| h.steps > 0) {
        let t = heal::Targets::measure(&original.model, &ids, window, usize::MAX, |done, n| {
            progress(Stage::Calibrating, done * window, n * window)
        })?;
        out.targets = Some(t);
    }
    // A GPU's queued work finishes before the clock is read.
    device.synchronize()?;
    out.secs = start.elapsed().as_secs_f64() - text_secs;
    Ok(out)
}
