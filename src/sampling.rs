//! The sampler: takes logits and returns a token id, with a seeded RNG. It knows nothing of
//! the model. The filters run in transformers' order: repetition penalty, temperature,
//! top-k, top-p, min-p.

use crate::error::{Error, Result};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::borrow::Cow;

/// How the next token is picked; temperature 0 is `Greedy`, decided once.
#[derive(Debug, Clone, PartialEq)]
pub enum Sampling {
    Greedy,
    Random {
        temperature: f32,
        /// Keep the `top_k` most likely tokens (0: off).
        top_k: usize,
        /// Keep the smallest set of tokens whose probability reaches `top_p` (1: off).
        top_p: f32,
        /// Drop tokens less likely than `min_p` times the most likely one (0: off).
        min_p: f32,
    },
}

/// Sampling parameters as a user gives them.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    /// Penalty for tokens already in the sequence (1: off), as in transformers.
    pub repeat_penalty: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            seed: 299792458,
        }
    }
}

pub struct Sampler {
    sampling: Sampling,
    repeat_penalty: f32,
    rng: StdRng,
}

impl Sampler {
    /// Validates the parameters; each error names the flag.
    pub fn new(p: &SamplingParams) -> Result<Self> {
        let bad = |msg: String| Err(Error::Invalid(msg));
        if !(p.temperature >= 0.0 && p.temperature.is_finite()) {
            return bad(format!("--temperature must be >= 0, got {}", p.temperature));
        }
        if !(p.top_p > 0.0 && p.top_p <= 1.0) {
            return bad(format!("--top-p must be in (0, 1], got {}", p.top_p));
        }
        if !(0.0..=1.0).contains(&p.min_p) {
            return bad(format!("--min-p must be in [0, 1], got {}", p.min_p));
        }
        if !(p.repeat_penalty > 0.0 && p.repeat_penalty.is_finite()) {
            return bad(format!(
                "--repeat-penalty must be > 0, got {}",
                p.repeat_penalty
            ));
        }
        let sampling = match p.temperature {
            0.0 => Sampling::Greedy,
            temperature => Sampling::Random {
                temperature,
                top_k: p.top_k,
                top_p: p.top_p,
                min_p: p.min_p,
            },
        };
        Ok(Self {
            sampling,
            repeat_penalty: p.repeat_penalty,
            rng: StdRng::seed_from_u64(p.seed),
        })
    }

    /// Picks the next token from `logits` (one per vocabulary entry) given the sequence so far.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        // Copy the logits only when the penalty has to change them.
        let logits: Cow<[f32]> = match self.repeat_penalty {
            1.0 => Cow::Borrowed(logits),
            penalty => {
                let mut owned = logits.to_vec();
                apply_repeat_penalty(&mut owned, history, penalty);
                Cow::Owned(owned)
            }
        };
        match self.sampling {
            Sampling::Greedy => argmax(&logits),
            Sampling::Random {
                temperature,
                top_k,
                top_p,
                min_p,
            } => {
                let probs = filtered_probs(&logits, temperature, top_k, top_p, min_p);
                let mut u: f32 =
                    self.rng.random::<f32>() * probs.iter().map(|(_, p)| p).sum::<f32>();
                for &(id, p) in &probs {
                    if u < p {
                        return id;
                    }
                    u -= p;
                }
                probs.last().map_or(0, |&(id, _)| id)
            }
        }
    }
}

/// The first index of the largest logit (NaN never wins).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] || logits[best].is_nan() {
            best = i;
        }
    }
    best as u32
}

/// transformers' RepetitionPenaltyLogitsProcessor: divide positive logits, multiply negative.
pub fn apply_repeat_penalty(logits: &mut [f32], history: &[u32], penalty: f32) {
    let mut seen = vec![false; logits.len()];
    for &id in history {
        let i = id as usize;
        if i < logits.len() && !seen[i] {
            seen[i] = true;
            logits[i] = if logits[i] < 0.0 {
                logits[i] * penalty
            } else {
                logits[i] / penalty
            };
        }
    }
}

/// Softmax at `temperature`, then the top-k, top-p and min-p filters. Returns the surviving
/// (id, probability) pairs, most likely first; probabilities are not renormalised.
pub fn filtered_probs(
    logits: &[f32],
    temperature: f32,
    top_k: usize,
    top_p: f32,
    min_p: f32,
) -> Vec<(u32, f32)> {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let mut probs: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, ((l - max) / temperature).exp()))
        .collect();
    let total: f32 = probs.iter().map(|(_, p)| p).sum();
    probs.iter_mut().for_each(|(_, p)| *p /= total);
    probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if top_k > 0 && top_k < probs.len() {
        probs.truncate(top_k);
        // top-p sees the distribution that top-k left, renormalised (as in transformers).
        let kept: f32 = probs.iter().map(|(_, p)| p).sum();
        probs.iter_mut().for_each(|(_, p)| *p /= kept);
    }
    if top_p < 1.0 {
        // Keep tokens until the kept mass reaches top_p (at least one).
        let mut mass = 0.0;
        let keep = probs.iter().take_while(|(_, p)| {
            let before = mass;
            mass += p;
            before < top_p
        });
        let n = keep.count().max(1);
        probs.truncate(n);
    }
    if min_p > 0.0 {
        let threshold = min_p * probs[0].1;
        probs.retain(|&(_, p)| p >= threshold);
    }
    probs
}
