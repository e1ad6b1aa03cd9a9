//! One forward of the original model over a calibration text, keeping of each layer only
//! the second moment of its attention's input: every activation-aware fit is computed
//! from these (keys, values and queries are linear in the input), so the text is read once.

use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::model::{Transformer, PREFILL_CHUNK};
use candle_core::{DType, Device, Tensor};

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
    let mut cache = KvCache::new(cfg, window, model.dtype(), model.device())?;
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
    let mut cache = KvCache::new(cfg, window, model.dtype(), model.device())?;
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
