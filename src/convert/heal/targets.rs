//! The original model's next-token distribution over the calibration windows, what the
//! end-to-end training ([`super::distil`]) aims at: its [`TOP_K`] most probable next tokens
//! per position with their probabilities, the rest of the vocabulary one more outcome
//! holding what they leave (renormalised among themselves instead, the targets taught the
//! converted model to give every other token nothing, and a real text's next token is one of
//! them now and then: SmolLM2 `mla:192`'s passage NLL rose as its own-text loss fell).

use crate::error::Result;
use crate::model::attention::decode::softmax_row;
use crate::model::linear::simd::Isa;
use crate::model::pool::each_row;
use crate::model::Transformer;
use candle_core::{DType, Device, Tensor};
use std::sync::Mutex;

/// The original's most probable next tokens kept per position.
pub const TOP_K: usize = 64;

/// The original model's next-token distribution over windows of a calibration text.
pub struct Targets {
    /// Each window's tokens, (T,) u32.
    ids: Vec<Tensor>,
    /// Per window, each position's [`TOP_K`] most probable next tokens (T, K) u32 and their
    /// probabilities, (T, K) f32 (summing to 1 less the rest's).
    top: Vec<(Tensor, Tensor)>,
}

impl Targets {
    /// The original `model` over up to `count` windows of `window` tokens of `ids`, one
    /// after another; `progress(done, total)` after each.
    pub fn measure(
        model: &Transformer,
        ids: &[u32],
        window: usize,
        count: usize,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Self> {
        let n = (ids.len() / window).min(count);
        let mut cache = model.new_cache(window)?;
        let mut out = Targets {
            ids: Vec::with_capacity(n),
            top: Vec::with_capacity(n),
        };
        for (w, tokens) in ids.chunks_exact(window).take(n).enumerate() {
            cache.reset();
            let input = Tensor::new(tokens, model.device())?.unsqueeze(0)?;
            let logits = model
                .forward(&input, &mut cache)?
                .squeeze(0)?
                .to_dtype(DType::F32)?
                .to_device(&Device::Cpu)?;
            let (t, v) = logits.dims2()?;
            let mut logits = logits.flatten_all()?.to_vec1::<f32>()?;
            let k = TOP_K.min(v);
            let rows: Vec<Mutex<(Vec<u32>, Vec<f32>)>> = (0..t).map(|_| Mutex::default()).collect();
            each_row(&mut logits, v, |r, row| {
                *rows[r].lock().unwrap_or_else(|e| e.into_inner()) = top_k(row, k);
            });
            let (mut top, mut p) = (Vec::with_capacity(t * k), Vec::with_capacity(t * k));
            for row in rows {
                let (ids, probs) = row.into_inner().unwrap_or_else(|e| e.into_inner());
                top.extend(ids);
                p.extend(probs);
            }
            out.ids.push(Tensor::new(tokens, &Device::Cpu)?);
            out.top.push((
                Tensor::from_vec(top, (t, k), &Device::Cpu)?,
                Tensor::from_vec(p, (t, k), &Device::Cpu)?,
            ));
            progress(w + 1, n);
        }
        Ok(out)
    }

    pub fn windows(&self) -> usize {
        self.ids.len()
    }

    /// Tokens in all windows.
    pub fn tokens(&self) -> usize {
        self.ids.len() * self.window()
    }

    /// Tokens per window.
    pub fn window(&self) -> usize {
        self.ids.first().map_or(0, |w| w.elem_count())
    }

    /// Windows `picks` stacked on `device`: ids (B, T), top tokens and probabilities (B·T, K).
    pub(super) fn batch(
        &self,
        picks: &[usize],
        device: &Device,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let ids: Vec<&Tensor> = picks.iter().map(|&i| &self.ids[i]).collect();
        let top: Vec<&Tensor> = picks.iter().map(|&i| &self.top[i].0).collect();
        let p: Vec<&Tensor> = picks.iter().map(|&i| &self.top[i].1).collect();
        Ok((
            Tensor::stack(&ids, 0)?.to_device(device)?,
            Tensor::cat(&top, 0)?.to_device(device)?,
            Tensor::cat(&p, 0)?.to_device(device)?,
        ))
    }
}

/// The `k` largest of `logits` (most likely first; selected, not sorted whole: a
/// vocabulary of 50k a position) and their probabilities, the softmax over all of `logits`,
/// which it leaves as `exp(logit − max)`.
fn top_k(logits: &mut [f32], k: usize) -> (Vec<u32>, Vec<f32>) {
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]);
    if k < ids.len() {
        ids.select_nth_unstable_by(k - 1, by_logit);
        ids.truncate(k);
    }
    ids.sort_unstable_by(by_logit);
    let (_, sum) = softmax_row(Isa::current(), logits, 1.0);
    let p = ids.iter().map(|&i| logits[i as usize] / sum).collect();
    (ids, p)
}

#[cfg(test)]
mod tests {
    use super::top_k;

    #[test]
    fn top_k_selects_the_largest_with_their_probabilities() {
        // A scrambled vocabulary of 1000: logit i/100 at a position that varies.
        let v = 1000;
        let logits: Vec<f32> = (0..v).map(|i| ((i * 617) % v) as f32 / 100.0).collect();
        let (ids, p) = top_k(&mut logits.clone(), 5);
        let want: Vec<u32> = (0..5).map(|r| ((v - 1 - r) * 953 % v) as u32).collect();
        // 617 · 953 ≡ 1 (mod 1000): token (j·953) mod 1000 has logit j/100.
        assert_eq!(ids, want);
        let z: f32 = (0..v).map(|r| (-(r as f32) / 100.0).exp()).sum();
        for (r, &q) in p.iter().enumerate() {
            assert!(
                (q - (-(r as f32) / 100.0).exp() / z).abs() < 1e-6,
                "{r}: {q}"
            );
        }
        // k past the vocabulary: all of it, most likely first, summing to 1.
        let e2 = 2f32.exp();
        let (ids, p) = top_k(&mut [1.0, 3.0], 64);
        assert_eq!(ids, vec![1, 0]);
        assert!((p[0] - e2 / (1.0 + e2)).abs() < 1e-6 && (p[1] - 1.0 / (1.0 + e2)).abs() < 1e-6);
    }
}
