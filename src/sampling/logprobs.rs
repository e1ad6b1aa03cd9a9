//! Log-probabilities of tokens, for OpenAI's `logprobs`: the log-softmax of the logits at a
//! temperature, for the token drawn and for the most likely ones, without sorting the
//! vocabulary (the top ones come from the sampler's partial selection).

use super::{exps, max_of, most_likely, sum_of};

/// A token's log-probability, and the most likely tokens of the same step with theirs.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub id: u32,
    /// ln p(id); `-inf` for a token the distribution rules out (a `-inf` logit).
    pub logprob: f32,
    /// The most likely tokens, most likely first (ties: lower id first); may include `id`.
    pub top: Vec<(u32, f32)>,
}

/// ln softmax(logits / temperature) at `id`, and the `top` most likely tokens with theirs
/// (`top` 0: none). `id` must be below `logits.len()`.
pub fn token_logprob(logits: &[f32], temperature: f32, id: u32, top: usize) -> TokenLogprob {
    let max = max_of(logits);
    let mut e = vec![0.0; logits.len()];
    exps(logits, max, temperature, &mut e);
    let ln_total = sum_of(&e).ln();
    // From the logit, not ln(e[i] / total): a token far below the top keeps its value
    // instead of rounding to ln(0).
    let logprob = |i: u32| (logits[i as usize] - max) / temperature - ln_total;
    let top = match top.min(logits.len()) {
        0 => Vec::new(),
        n => most_likely(&e, n)
            .into_iter()
            .map(|(i, _)| (i, logprob(i)))
            .collect(),
    };
    TokenLogprob {
        id,
        logprob: logprob(id),
        top,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ln softmax computed the plain way, in f64.
    fn reference(logits: &[f32], t: f64) -> Vec<f64> {
        let max = logits.iter().fold(f64::MIN, |m, &l| m.max(l as f64));
        let total: f64 = logits.iter().map(|&l| ((l as f64 - max) / t).exp()).sum();
        logits
            .iter()
            .map(|&l| (l as f64 - max) / t - total.ln())
            .collect()
    }

    #[test]
    fn equals_log_softmax_at_the_temperature() {
        let logits: Vec<f32> = (0..300)
            .map(|i| ((i * 37 % 101) as f32) * 0.13 - 4.0)
            .collect();
        for t in [1.0f32, 0.7, 1.5] {
            let want = reference(&logits, t as f64);
            for id in [0u32, 7, 299] {
                let got = token_logprob(&logits, t, id, 0);
                assert!(
                    (got.logprob as f64 - want[id as usize]).abs() < 1e-5,
                    "{t} {id}"
                );
                assert!(got.top.is_empty());
            }
        }
    }

    #[test]
    fn top_tokens_are_the_most_likely_in_order() {
        // Negative logits and a vocabulary smaller than the request: every token, sorted.
        let logits = [-3.0f32, -1.0, -2.0, f32::NEG_INFINITY, -1.0];
        let got = token_logprob(&logits, 1.0, 2, 10);
        let ids: Vec<u32> = got.top.iter().map(|&(i, _)| i).collect();
        assert_eq!(ids, [1, 4, 2, 0, 3]);
        let want = reference(&logits, 1.0);
        assert!((got.top[0].1 as f64 - want[1]).abs() < 1e-6);
        assert_eq!(got.top[4].1, f32::NEG_INFINITY);
        assert_eq!(got.logprob, got.top[2].1);
        let probs: f64 = got.top.iter().map(|&(_, l)| (l as f64).exp()).sum();
        assert!((probs - 1.0).abs() < 1e-6);
    }
}
