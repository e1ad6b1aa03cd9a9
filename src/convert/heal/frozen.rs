//! Everything of the model but its converted attention, frozen in f32, for `--heal`'s
//! end-to-end training ([`super::distil`]): its forward in candle's differentiable ops
//! with the attention forms given, and the loss against the original's next-token
//! distribution ([`grouped_cross_entropy`], through [`Head`]).

use super::attend::{output, Form};
use super::head_loss::Head;
use super::product::Weight;
use super::targets::Targets;
use super::{batch, Geometry};
use crate::config::{AttentionConfig, MlpConfig, ModelConfig};
use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor, D};
use candle_nn::var_builder::SimpleBackend;

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
    pub(super) fn loss(
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
    pub(super) fn score(
        &self,
        forms: &[Form],
        targets: &Targets,
        picks: &[usize],
        geo: &Geometry,
        mask: &Tensor,
    ) -> Result<f64> {
        let mut sum = 0.0;
        for chunk in picks.chunks(batch(targets.window())) {
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

#[cfg(test)]
mod tests {
    use super::*;

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
