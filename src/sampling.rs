//! The sampler: takes logits and returns a token id, with a seeded RNG. It knows nothing of
//! the model. The filters run in transformers' order: repetition penalty, temperature,
//! top-k, top-p, min-p.
//!
//! A draw walks down the tokens most likely first, but the vocabulary is never sorted whole
//! (23 ms at Qwen's 152k entries): every filter keeps a prefix of that order, and so does a
//! walk, so only the tokens above a threshold that surely holds the prefix are sorted. The
//! passes over the whole vocabulary (max, exp, sums) are in [`softmax`], written to vectorise.

use crate::error::{Error, Result};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::borrow::Cow;

pub mod defaults;
mod logprobs;
mod softmax;
pub use defaults::Requested;
pub use logprobs::TokenLogprob;
pub use softmax::softmax;
use softmax::{exps, max_of, sum_of};

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
        let logits = self.penalised(logits, history);
        match self.sampling {
            Sampling::Greedy => argmax(&logits),
            Sampling::Random {
                temperature,
                top_k,
                top_p,
                min_p,
            } => {
                let probs = softmax(&logits, temperature);
                let r = self.rng.random::<f32>();
                match filter(&probs, top_k, top_p, min_p) {
                    Some(kept) => walk(&kept, r * kept.iter().map(|(_, p)| p).sum::<f32>()),
                    None => {
                        // No filter: sort only as far down as the walk goes, with a margin
                        // for the rounding of its subtractions.
                        let u = r * sum_of(&probs);
                        walk(&nucleus(&probs, (u + 1e-4).min(1.0), 0.0), u)
                    }
                }
            }
        }
    }

    /// The log-probability of `id`, and the `top` most likely tokens with theirs, in the
    /// distribution [`Sampler::sample`] draws from before its filters: after the repetition
    /// penalty and the temperature (1 for greedy), as OpenAI's `logprobs` report it.
    pub fn logprobs(&self, logits: &[f32], history: &[u32], id: u32, top: usize) -> TokenLogprob {
        let temperature = match self.sampling {
            Sampling::Greedy => 1.0,
            Sampling::Random { temperature, .. } => temperature,
        };
        logprobs::token_logprob(&self.penalised(logits, history), temperature, id, top)
    }

    /// The logits after the repetition penalty, copied only when the penalty changes them.
    fn penalised<'l>(&self, logits: &'l [f32], history: &[u32]) -> Cow<'l, [f32]> {
        match self.repeat_penalty {
            1.0 => Cow::Borrowed(logits),
            penalty => {
                let mut owned = logits.to_vec();
                apply_repeat_penalty(&mut owned, history, penalty);
                Cow::Owned(owned)
            }
        }
    }
}

/// A draw: the first of `sorted` (most likely first) where the mass walked past reaches `u`,
/// or the last one of non-zero probability if rounding leaves some of `u` over.
fn walk(sorted: &[(u32, f32)], mut u: f32) -> u32 {
    for &(id, p) in sorted {
        if u < p {
            return id;
        }
        u -= p;
    }
    // The last token that can be drawn: never one a mask ruled out (probability 0).
    let drawable = sorted
        .iter()
        .rev()
        .find(|&&(_, p)| p > 0.0)
        .or(sorted.last());
    drawable.map_or(0, |&(id, _)| id)
}

/// The first index of the largest logit (NaN never wins): the maximum, then where it is.
pub fn argmax(logits: &[f32]) -> u32 {
    let max = max_of(logits);
    logits.iter().position(|&l| l == max).unwrap_or(0) as u32
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
/// (id, probability) pairs, most likely first (ties: lower id first); probabilities are not
/// renormalised. With no filter on, that is every token sorted, which [`Sampler`] avoids.
pub fn filtered_probs(
    logits: &[f32],
    temperature: f32,
    top_k: usize,
    top_p: f32,
    min_p: f32,
) -> Vec<(u32, f32)> {
    let probs = softmax(logits, temperature);
    filter(&probs, top_k, top_p, min_p).unwrap_or_else(|| above(&probs, 0.0))
}

/// The filters on `probs` (in id order), `None` if none is on. The survivors are always the
/// first tokens in sampling order, so only a prefix that surely holds them is sorted; each
/// filter then runs on it as it would on the whole vocabulary sorted.
fn filter(probs: &[f32], top_k: usize, top_p: f32, min_p: f32) -> Option<Vec<(u32, f32)>> {
    let mut kept = if top_k > 0 && top_k < probs.len() {
        let mut kept = most_likely(probs, top_k);
        // top-p sees the distribution that top-k left, renormalised (as in transformers).
        let mass: f32 = kept.iter().map(|(_, p)| p).sum();
        kept.iter_mut().for_each(|(_, p)| *p /= mass);
        kept
    } else if top_p < 1.0 || min_p > 0.0 {
        // min-p's threshold is relative to the most likely token, which top-p always keeps.
        let floor = min_p * max_of(probs);
        match top_p < 1.0 {
            true => nucleus(probs, top_p, floor),
            false => above(probs, floor),
        }
    } else {
        return None;
    };
    if top_p < 1.0 {
        kept.truncate(nucleus_len(&kept, top_p));
    }
    if let (true, Some(&(_, first))) = (min_p > 0.0, kept.first()) {
        let threshold = min_p * first;
        kept.retain(|&(_, p)| p >= threshold);
    }
    Some(kept)
}

/// How many tokens of `sorted` top-p keeps: tokens while the mass before each is below
/// `top_p`, at least one.
fn nucleus_len(sorted: &[(u32, f32)], top_p: f32) -> usize {
    let mut mass = 0.0;
    let kept = sorted.iter().take_while(|(_, p)| {
        let before = mass;
        mass += p;
        before < top_p
    });
    kept.count().max(1)
}

/// The tokens at least `floor` likely, most likely first (ties: lower id first).
fn above(probs: &[f32], floor: f32) -> Vec<(u32, f32)> {
    let mut kept: Vec<(u32, f32)> = (0u32..)
        .zip(probs.iter().copied())
        .filter(|&(_, p)| p >= floor)
        .collect();
    kept.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    kept
}

/// The `k` most likely tokens (0 < k), sorted. Of the maxima of 64-token blocks, the k-th
/// largest is at most the k-th largest probability (k blocks each hold a token at least that
/// likely), so only the tokens at or above it are sorted.
fn most_likely(probs: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut maxima: Vec<f32> = probs.chunks(64).map(max_of).collect();
    let floor = match k <= maxima.len() {
        true => {
            *maxima
                .select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a))
                .1
        }
        false => 0.0,
    };
    let mut kept = above(probs, floor);
    kept.truncate(k);
    kept
}

/// A sorted prefix holding the top-p nucleus and every token at least `floor` likely. One
/// pass sums the probability per binary exponent; from the top, the first power of two with
/// `top_p` of the mass above it is the cut. The cut is checked with the very running sum
/// top-p then makes (if it reaches `top_p`, no later token is kept) and lowered to the next
/// power of two if rounding left it short.
fn nucleus(probs: &[f32], top_p: f32, floor: f32) -> Vec<(u32, f32)> {
    let mut mass = [0.0f32; 256]; // at e: the tokens in [2^(e-127), 2^(e-126))
    for &p in probs {
        mass[(p.to_bits() >> 23) as usize & 255] += p;
    }
    let (mut top, mut sum) = (255, 0.0); // 255 holds inf and NaN: never a cut
    while top > 0 && sum < top_p {
        top -= 1;
        sum += mass[top];
    }
    for e in (0..=top as u32)
        .rev()
        .filter(|&e| e == 0 || mass[e as usize] > 0.0)
    {
        let cut = f32::from_bits(e << 23).max(floor); // 2^(e-127), or 0 at e = 0
        let kept = above(probs, cut);
        if cut == floor || kept.iter().map(|(_, p)| p).sum::<f32>() >= top_p {
            return kept;
        }
    }
    above(probs, floor) // not reached: the cut ends at 0 <= floor
}
