//! Teacher-forced evaluation: mean negative log-likelihood of a token sequence, the number
//! transformers reports as `model(ids, labels=ids).loss`, over context-length windows.

use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::model::Transformer;
use candle_core::{DType, Tensor, D};

/// Sum of NLL and number of predicted tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Nll {
    pub sum: f64,
    pub tokens: usize,
}

impl Nll {
    pub fn mean(&self) -> f64 {
        self.sum / self.tokens.max(1) as f64
    }

    pub fn perplexity(&self) -> f64 {
        self.mean().exp()
    }
}

/// Predicts every token after the first. Sequences longer than the context are cut into
/// windows of the context length that overlap by one token, so each token is predicted
/// exactly once, from at most `context - 1` tokens of history.
pub fn evaluate(model: &Transformer, ids: &[u32]) -> Result<Nll> {
    if ids.len() < 2 {
        return Err(Error::Invalid(format!(
            "need at least 2 tokens to evaluate, got {}",
            ids.len()
        )));
    }
    let context = model.config().max_position_embeddings;
    let mut nll = Nll::default();
    let mut start = 0;
    while start + 1 < ids.len() {
        let window = &ids[start..(start + context).min(ids.len())];
        let mut cache = KvCache::new(model.config(), window.len(), model.dtype(), model.device())?;
        let input = Tensor::new(window, model.device())?.unsqueeze(0)?;
        let logits = model.forward(&input, &mut cache)?.squeeze(0)?; // (T, V)
        let t = window.len();
        let log_probs = candle_nn::ops::log_softmax(&logits.narrow(0, 0, t - 1)?, D::Minus1)?;
        let targets = Tensor::new(&window[1..], model.device())?.unsqueeze(1)?;
        let picked = log_probs.gather(&targets, 1)?.to_dtype(DType::F64)?;
        nll.sum -= picked.sum_all()?.to_scalar::<f64>()?;
        nll.tokens += t - 1;
        start += t - 1;
    }
    Ok(nll)
}
