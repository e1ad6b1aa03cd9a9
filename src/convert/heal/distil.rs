//! `--heal`'s second part, end to end: after the layer-wise fit, every converted layer's
//! attention is trained at once so that the converted model's next-token distribution
//! matches the original's on the calibration windows (distillation, as TransMLA and
//! X-EcoMLA recover a conversion's loss), everything else frozen. Errors that add up
//! through the layers, which the layer-wise fit never sees, are what this aims at.
//!
//! The original's distribution is kept as its most probable next tokens per position and
//! the rest of the vocabulary as one outcome ([`Targets`]): the loss is its cross-entropy
//! against the converted model's distribution grouped the same way (the KL divergence up
//! to a constant). The converted
//! model runs once more in candle's differentiable basic ops ([`Frozen::logits`]), the
//! attention through [`super::attend`]. The last [`HELD_OUT`]th of the windows is held
//! out: it is scored before training and every [`CHECK_EVERY`] steps, and the best state
//! it saw is what is kept (the layer-wise result when nothing beats it).

use super::attend::{mask, output, Form};
use super::head_loss::Head;
use super::product::Weight;
use super::targets::Targets;
use super::{Geometry, WINDOW};
use crate::config::{AttentionConfig, MlpConfig, ModelConfig};
use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor, Var, D};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use std::time::Instant;

/// Windows per optimiser step.
const BATCH: usize = 4;
/// One window in this many is held out (at least one, at most [`HELD_OUT_MAX`]).
const HELD_OUT: usize = 8;
const HELD_OUT_MAX: usize = 4;
/// Steps between checks on the held-out windows.
const CHECK_EVERY: usize = 10;
/// At a check that scores worse than the best state so far, training goes back to that
/// state and on at this fraction of its learning rate, with fresh moments. (SmolLM2's
/// `mla:192,rope=64` on its own text: every check at 1e-4 scored worse than the layer-wise
/// fit, while 3e-5 improved on it: +0.070 nats on the passage against +0.093.)
const BACKOFF: f64 = 0.3;
/// Added to the converted model's probability of the rest of the vocabulary before its log.
pub(super) const REST_FLOOR: f64 = 1e-6;

/// Everything of the model but the converted attention, in f32, frozen.
pub struct Frozen {
    embed: Tensor,
    layers: Vec<FrozenLayer>,
    norm: Tensor,
    head: Head,
    eps: f64,
}

struct FrozenLayer {
    input_norm: Tensor,
    post_norm: Tensor,
    o_bias: Option<Tensor>,
    /// gate, up, down: (weight, bias).
    mlp: [(Weight, Option<Tensor>); 3],
}

impl Frozen {
    /// Reads the frozen tensors of a Llama-family checkpoint with dense MLPs onto `device`.
    pub fn load(backend: &dyn SimpleBackend, cfg: &ModelConfig, device: &Device) -> Result<Self> {
        let AttentionConfig::Gqa { o_bias, .. } = cfg.attention else {
            return Err(Error::Invalid("--heal: not a GQA-family model".into()));
        };
        let get =
            |name: &str| -> Result<Tensor> { Ok(backend.get_unchecked(name, DType::F32, device)?) };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for (l, mlp) in cfg.mlp.iter().enumerate() {
            let MlpConfig::Dense { bias, .. } = mlp else {
                return Err(Error::Invalid(format!(
                    "--heal: layer {l} has a mixture of experts; healing trains through \
                     dense MLPs only"
                )));
            };
            let p = format!("model.layers.{l}");
            let proj = |name: &str| -> Result<(Weight, Option<Tensor>)> {
                let w = Weight::new(get(&format!("{p}.mlp.{name}.weight"))?)?;
                let b = match bias {
                    true => Some(get(&format!("{p}.mlp.{name}.bias"))?),
                    false => None,
                };
                Ok((w, b))
            };
            layers.push(FrozenLayer {
                input_norm: get(&format!("{p}.input_layernorm.weight"))?,
                post_norm: get(&format!("{p}.post_attention_layernorm.weight"))?,
                o_bias: match o_bias {
                    true => Some(get(&format!("{p}.self_attn.o_proj.bias"))?),
                    false => None,
                },
                mlp: [proj("gate_proj")?, proj("up_proj")?, proj("down_proj")?],
            });
        }
        let embed = get("model.embed_tokens.weight")?;
        let head = match cfg.tie_word_embeddings {
            true => embed.clone(),
            false => get("lm_head.weight")?,
        };
        Ok(Self {
            embed,
            layers,
            norm: get("model.norm.weight")?,
            head: Head::new(head)?,
            eps: cfg.rms_norm_eps,
        })
    }

    fn rms(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        let scale = (x.sqr()?.mean_keepdim(D::Minus1)? + self.eps)?
            .sqrt()?
            .recip()?;
        Ok(x.broadcast_mul(&scale)?.broadcast_mul(w)?)
    }

    /// The converted model's last hidden states, normed, (B·T, C) for `ids` (B, T) with
    /// `forms` as its layers' attention (f32), in differentiable ops.
    fn hidden(
        &self,
        forms: &[Form],
        ids: &Tensor,
        geo: &Geometry,
        mask: &Tensor,
    ) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let c = self.embed.dim(1)?;
        let mut x = self
            .embed
            .index_select(&ids.flatten_all()?, 0)?
            .reshape((b, t, c))?;
        let ones = Tensor::ones((b, t, 1), DType::F32, x.device())?;
        let linear = |x: &Tensor, (w, bias): &(Weight, Option<Tensor>)| -> Result<Tensor> {
            let y = w.product(x)?;
            Ok(match bias {
                Some(bias) => y.broadcast_add(bias)?,
                None => y,
            })
        };
        for (layer, form) in self.layers.iter().zip(forms) {
            let h = Tensor::cat(&[&self.rms(&x, &layer.input_norm)?, &ones], 2)?;
            let mut a = output(form, &h, geo, mask)?;
            if let Some(bias) = &layer.o_bias {
                a = a.broadcast_add(bias)?;
            }
            x = (x + a)?;
            let h = self.rms(&x, &layer.post_norm)?;
            let [gate, up, down] = &layer.mlp;
            let g = candle_nn::ops::silu(&linear(&h, gate)?)?;
            x = (&x + linear(&(g * linear(&h, up)?)?, down)?)?;
        }
        Ok(self.rms(&x, &self.norm)?.reshape((b * t, c))?)
    }

    /// [`grouped_cross_entropy`] of the converted model's logits for `batch`'s windows
    /// ([`Head::loss`]).
    fn loss(
        &self,
        forms: &[Form],
        batch: &(Tensor, Tensor, Tensor),
        geo: &Geometry,
        mask: &Tensor,
    ) -> Result<Tensor> {
        let (ids, top, p) = batch;
        self.head.loss(&self.hidden(forms, ids, geo, mask)?, top, p)
    }

    /// `loss` over windows `picks`, a batch at a time, without gradients.
    fn score(
        &self,
        forms: &[Form],
        targets: &Targets,
        picks: &[usize],
        geo: &Geometry,
        mask: &Tensor,
    ) -> Result<f64> {
        let mut sum = 0.0;
        for chunk in picks.chunks(BATCH) {
            let l = self.loss(forms, &targets.batch(chunk, &geo.device)?, geo, mask)?;
            sum += l.to_scalar::<f32>()? as f64 * chunk.len() as f64;
        }
        Ok(sum / picks.len() as f64)
    }
}

/// The mean over positions of the cross-entropy of the original's next-token distribution,
/// its top tokens `top` (B·T, K) with probabilities `p` and the rest of the vocabulary as
/// one more outcome, against that of `logits` (B·T, V) grouped the same way.
pub(super) fn grouped_cross_entropy(logits: &Tensor, top: &Tensor, p: &Tensor) -> Result<Tensor> {
    let picked = candle_nn::ops::log_softmax(logits, D::Minus1)?.gather(top, 1)?;
    // The rest's probability on both sides (at least 0: the sums round), ours lifted off 0
    // by REST_FLOOR, which keeps its gradient where it is tiny. Where the original leaves
    // the rest nothing, the term is 0 whatever ours is.
    let rest = |p: &Tensor| -> Result<Tensor> { Ok((1.0 - p.sum_keepdim(1)?)?.relu()?) };
    let ours = (rest(&picked.exp()?)? + REST_FLOOR)?.log()?;
    let cross = ((&picked * p)?.sum_all()? + (ours * rest(p)?)?.sum_all()?)?;
    Ok((cross / -(top.dim(0)? as f64))?)
}

/// What the end-to-end training did: held-out loss (nats per position, the original's
/// top-K cross-entropy) before and after, and its cost.
#[derive(Debug, Clone, Copy)]
pub struct Distilled {
    pub steps: usize,
    /// The learning rate at the first step.
    pub lr: f64,
    pub tokens: usize,
    pub secs: f64,
    pub before: f64,
    pub after: f64,
}

/// Trains every layer's `forms` (f64 on the CPU, as the layer-wise fit leaves them) together
/// towards `targets` for `steps` AdamW steps (without weight decay) at learning rate `lr`
/// decaying linearly to a tenth, on `geo`'s device; `progress(done, steps)` after each.
/// Returns the forms the held-out windows liked best, in f64 on the CPU.
pub fn distil(
    frozen: &Frozen,
    forms: Vec<Form>,
    targets: &Targets,
    geo: &Geometry,
    (steps, lr): (usize, f64),
    mut progress: impl FnMut(usize, usize),
) -> Result<(Vec<Form>, Distilled)> {
    let start = Instant::now();
    if !(lr.is_finite() && lr > 0.0) {
        return Err(Error::Invalid(format!(
            "--heal-lr {lr}: give a finite learning rate above 0"
        )));
    }
    let n = targets.windows();
    if n < 2 {
        return Err(Error::Invalid(format!(
            "--heal: the calibration text gives {n} window(s) of {WINDOW} tokens; healing \
             end to end needs at least 2 (one to fit, one to check)"
        )));
    }
    let held = (n / HELD_OUT).clamp(1, HELD_OUT_MAX);
    let (fit, check): (Vec<usize>, Vec<usize>) = ((0..n - held).collect(), (n - held..n).collect());
    let mask = mask(WINDOW, &geo.device)?;
    let f32_forms = forms
        .iter()
        .map(|f| f.to(DType::F32, &geo.device))
        .collect::<Result<Vec<_>>>()?;
    let vars: Vec<Vec<Var>> = f32_forms
        .iter()
        .map(|f| f.tensors().into_iter().map(Var::from_tensor).collect())
        .collect::<candle_core::Result<_>>()?;
    let current = |detach: bool| -> Vec<Form> {
        f32_forms
            .iter()
            .zip(&vars)
            .map(|(f, vs)| {
                let ts: Vec<Tensor> = vs
                    .iter()
                    .map(|v| match detach {
                        true => v.as_tensor().detach(),
                        false => v.as_tensor().clone(),
                    })
                    .collect();
                f.with(&ts)
            })
            .collect()
    };
    let before = frozen.score(&f32_forms, targets, &check, geo, &mask)?;
    let mut best = (before, snapshot(&f32_forms)?);
    let params = ParamsAdamW {
        lr,
        weight_decay: 0.0,
        ..Default::default()
    };
    let adamw = || AdamW::new(vars.iter().flatten().cloned().collect(), params.clone());
    let (mut opt, mut scale) = (adamw()?, 1.0);
    for step in 0..steps {
        opt.set_learning_rate(scale * lr * (1.0 - 0.9 * step as f64 / steps as f64));
        let picks: Vec<usize> = (0..BATCH.min(fit.len()))
            .map(|i| fit[(step * BATCH + i) % fit.len()])
            .collect();
        let loss = frozen.loss(
            &current(false),
            &targets.batch(&picks, &geo.device)?,
            geo,
            &mask,
        )?;
        opt.backward_step(&loss)?;
        if (step + 1) % CHECK_EVERY == 0 || step + 1 == steps {
            let now = current(true);
            let score = frozen.score(&now, targets, &check, geo, &mask)?;
            if score < best.0 {
                best = (score, snapshot(&now)?);
            } else if step + 1 < steps {
                for (vs, f) in vars.iter().zip(&best.1) {
                    for (v, t) in vs.iter().zip(f.tensors()) {
                        v.set(t)?;
                    }
                }
                (opt, scale) = (adamw()?, scale * BACKOFF);
            }
        }
        progress(step + 1, steps);
    }
    let healed = best
        .1
        .iter()
        .map(|f| f.to(DType::F64, &Device::Cpu))
        .collect::<Result<Vec<_>>>()?;
    let report = Distilled {
        steps,
        lr,
        tokens: fit.len() * WINDOW,
        secs: start.elapsed().as_secs_f64(),
        before,
        after: best.0,
    };
    Ok((healed, report))
}

/// A copy of `forms` that training leaves alone: a detached tensor still shares its
/// variable's storage, which every optimiser step overwrites in place.
fn snapshot(forms: &[Form]) -> Result<Vec<Form>> {
    forms
        .iter()
        .map(|f| {
            let ts = f.tensors().into_iter().map(Tensor::copy);
            Ok(f.with(&ts.collect::<candle_core::Result<Vec<_>>>()?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The best state kept is a copy: setting the variables (as a step does) leaves it,
    /// where a detached view of them would follow.
    #[test]
    fn a_kept_state_does_not_follow_the_variables() -> Result<()> {
        let cpu = &Device::Cpu;
        let vars: Vec<Var> = (0..4)
            .map(|i| Var::from_tensor(&Tensor::full(i as f32, (2, 2), cpu)?))
            .collect::<candle_core::Result<_>>()?;
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().detach()).collect();
        let view = Form::Gqa {
            q: ts[0].clone(),
            k: ts[1].clone(),
            v: ts[2].clone(),
            o: ts[3].clone(),
        };
        let kept = snapshot(std::slice::from_ref(&view))?;
        for v in &vars {
            v.set(&Tensor::full(9f32, (2, 2), cpu)?)?;
        }
        let first =
            |f: &Form| -> Result<f32> { Ok(f.tensors()[1].flatten_all()?.to_vec1::<f32>()?[0]) };
        assert_eq!(first(&kept[0])?, 1.0);
        assert_eq!(first(&view)?, 9.0, "a detached view follows its variable");
        Ok(())
    }

    /// Two positions over a vocabulary of 3, the top 2 of each kept: by hand, the
    /// cross-entropy of (q₁, q₂, rest) against the logits' softmax grouped the same way.
    #[test]
    fn the_rest_of_the_vocabulary_is_one_more_outcome() -> Result<()> {
        let cpu = &Device::Cpu;
        let logits = [[1.0f32, 2.0, 0.5], [0.0, 0.0, 3.0]];
        let top = Tensor::new(&[[1u32, 0], [2, 0]], cpu)?;
        let q = [[0.6f32, 0.3], [0.9, 0.1]]; // the rest: 0.1, then 0
        let got = grouped_cross_entropy(&Tensor::new(&logits, cpu)?, &top, &Tensor::new(&q, cpu)?)?;
        let mut want = 0.0;
        for (r, (row, q)) in logits.iter().zip(q).enumerate() {
            let z: f32 = row.iter().map(|l| l.exp()).sum();
            let p = |i: usize| row[i].exp() / z;
            let ids = [[1, 0], [2, 0]][r];
            let rest = 1.0 - p(ids[0]) - p(ids[1]);
            let q_rest = 1.0 - q[0] - q[1];
            want -= q[0] * p(ids[0]).ln() + q[1] * p(ids[1]).ln();
            want -= q_rest * (rest + REST_FLOOR as f32).ln();
        }
        let got = got.to_scalar::<f32>()?;
        assert!(
            (got - want / 2.0).abs() < 1e-5,
            "{got} against {}",
            want / 2.0
        );
        Ok(())
    }
}
