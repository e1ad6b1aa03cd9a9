//! Teacher-forced evaluation: mean negative log-likelihood of a token sequence, the number
//! transformers reports as `model(ids, labels=ids).loss`, over windows as in transformers'
//! perplexity guide. Each window runs through one preallocated KV cache in chunks, and the
//! LM head runs only on the positions it scores, so memory is bounded by the window and the
//! chunk, never by the length of the text.

use crate::error::{Error, Result};
use crate::model::{Transformer, PREFILL_CHUNK};
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

/// How the text is cut: windows of `context` tokens, one starting every `stride` tokens
/// (`stride <= context`). A window scores the tokens no earlier window scored, each from
/// the tokens before it in the same window; a token with none before it (the first of the
/// text, or of a window when `stride == context`) is not scored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Windows {
    pub context: usize,
    pub stride: usize,
}

impl Windows {
    /// Windows of the model's context length overlapping by one token: every token after
    /// the first is scored exactly once, from as much history as fits.
    pub fn full(model: &Transformer) -> Self {
        let context = model.config().max_position_embeddings;
        Self {
            context,
            stride: context.saturating_sub(1).max(1),
        }
    }

    fn check(&self, model: &Transformer) -> Result<()> {
        let max = model.config().max_position_embeddings;
        if self.context < 2 || self.context > max {
            return Err(Error::Invalid(format!(
                "--context {} must be between 2 and the model's context length ({max})",
                self.context
            )));
        }
        if self.stride == 0 || self.stride > self.context {
            return Err(Error::Invalid(format!(
                "--stride {} must be between 1 and --context ({})",
                self.stride, self.context
            )));
        }
        Ok(())
    }

    /// `(begin, end, first scored)` of every window over `n` tokens.
    fn spans(&self, n: usize) -> Vec<(usize, usize, usize)> {
        let mut spans = Vec::new();
        let (mut begin, mut prev_end) = (0, 0);
        loop {
            let end = (begin + self.context).min(n);
            spans.push((begin, end, prev_end.max(begin + 1)));
            if end == n {
                return spans;
            }
            prev_end = end;
            begin += self.stride;
        }
    }
}

/// [`evaluate_windows`] with [`Windows::full`].
pub fn evaluate(model: &Transformer, ids: &[u32]) -> Result<Nll> {
    evaluate_windows(model, ids, Windows::full(model), |_, _| {})
}

/// Scores every token `windows` reaches; `progress(done, total)` is called after each
/// chunk with tokens processed so far.
pub fn evaluate_windows(
    model: &Transformer,
    ids: &[u32],
    windows: Windows,
    mut progress: impl FnMut(usize, usize),
) -> Result<Nll> {
    if ids.len() < 2 {
        return Err(Error::Invalid(format!(
            "need at least 2 tokens to evaluate, got {}",
            ids.len()
        )));
    }
    windows.check(model)?;
    let capacity = windows.context.min(ids.len());
    let mut cache = model.new_cache(capacity)?;
    let spans = windows.spans(ids.len());
    let total: usize = spans.iter().map(|(b, e, _)| e - b).sum();
    let (mut nll, mut done) = (Nll::default(), 0);
    for (begin, end, first) in spans {
        cache.reset();
        // Position p's logits score token p + 1: the window needs logits at first-1..end-1.
        for c0 in (begin..end).step_by(PREFILL_CHUNK) {
            let c1 = (c0 + PREFILL_CHUNK).min(end);
            let input = Tensor::new(&ids[c0..c1], model.device())?.unsqueeze(0)?; // (1, T)
            let from = (first - 1).clamp(c0, c1);
            let upto = (end - 1).clamp(from, c1);
            let logits = model.forward_tail(&input, &mut cache, c1 - from)?;
            if let (Some(logits), true) = (logits, upto > from) {
                let logits = logits.squeeze(0)?.narrow(0, 0, upto - from)?; // (scored, V)
                let log_probs = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
                let targets = Tensor::new(&ids[from + 1..upto + 1], model.device())?;
                let picked = log_probs.gather(&targets.unsqueeze(1)?, 1)?;
                nll.sum -= picked.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
                nll.tokens += upto - from;
            }
            done += c1 - c0;
            progress(done, total);
        }
    }
    Ok(nll)
}
