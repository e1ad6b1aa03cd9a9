//! DeepSeek's mixture of experts: a router picks `num_experts_per_tok` routed experts per
//! token, each expert runs only on the tokens routed to it, and shared experts run on all.

use super::swiglu::SwiGlu;
use crate::config::{MoeConfig, Router};
use crate::model::linear::Quantizer;
use candle_core::{DType, Module, Result, Tensor};
use candle_nn::VarBuilder;

#[derive(Debug, Clone)]
pub struct Moe {
    /// Router weight (n_routed_experts, hidden), in f32.
    gate: Tensor,
    /// V3 only: added to the scores to choose experts, never to weight them.
    e_score_correction_bias: Option<Vec<f32>>,
    experts: Vec<SwiGlu>,
    shared_experts: Option<SwiGlu>,
    cfg: MoeConfig,
}

impl Moe {
    /// Quantizes the experts (the router stays in f32); returns the bytes saved.
    pub fn quantize(&mut self, q: &dyn Quantizer) -> Result<usize> {
        let mut saved = 0;
        for e in self.experts.iter_mut().chain(self.shared_experts.as_mut()) {
            saved += e.quantize(q)?;
        }
        Ok(saved)
    }

    pub fn new(hidden: usize, cfg: &MoeConfig, vb: VarBuilder) -> Result<Self> {
        let (n, inter) = (cfg.n_routed_experts, cfg.moe_intermediate_size);
        // The router runs in f32 (as in transformers); convert its weights once, here.
        let gate = vb
            .pp("gate")
            .get((n, hidden), "weight")?
            .to_dtype(DType::F32)?;
        let e_score_correction_bias = match cfg.router {
            Router::SigmoidGrouped => {
                let bias = vb.pp("gate").get(n, "e_score_correction_bias")?;
                Some(bias.to_dtype(DType::F32)?.to_vec1::<f32>()?)
            }
            Router::Softmax { .. } => None,
        };
        let vb_e = vb.pp("experts");
        // transformers 5 keeps experts fused in memory (gate_up_proj (E, 2I, H), down_proj
        // (E, H, I)); hub checkpoints store one module per expert. Accept both.
        let experts = if vb_e.contains_tensor("gate_up_proj") {
            let gate_up = vb_e.get((n, 2 * inter, hidden), "gate_up_proj")?;
            let down = vb_e.get((n, hidden, inter), "down_proj")?;
            (0..n)
                .map(|e| {
                    let gu = gate_up.get(e)?;
                    Ok(SwiGlu::from_weights(
                        gu.narrow(0, 0, inter)?,
                        gu.narrow(0, inter, inter)?,
                        down.get(e)?,
                    ))
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            (0..n)
                .map(|e| SwiGlu::new(hidden, inter, false, vb_e.pp(e)))
                .collect::<Result<Vec<_>>>()?
        };
        let shared_experts = match cfg.n_shared_experts {
            0 => None,
            s => Some(SwiGlu::new(
                hidden,
                inter * s,
                false,
                vb.pp("shared_experts"),
            )?),
        };
        Ok(Self {
            gate,
            e_score_correction_bias,
            experts,
            shared_experts,
            cfg: cfg.clone(),
        })
    }

    /// Expert choices and weights for each token, from the router scores (N, E).
    fn route(&self, x: &Tensor) -> Result<Vec<Vec<(usize, f32)>>> {
        let logits = x.to_dtype(DType::F32)?.matmul(&self.gate.t()?)?;
        let (scores, bias) = match self.cfg.router {
            Router::Softmax { .. } => (candle_nn::ops::softmax_last_dim(&logits)?, None),
            Router::SigmoidGrouped => (
                candle_nn::ops::sigmoid(&logits)?,
                self.e_score_correction_bias.as_deref(),
            ),
        };
        let scores = scores.to_vec2::<f32>()?;
        Ok(scores
            .iter()
            .map(|s| route_token(s, bias, &self.cfg))
            .collect())
    }
}

/// Picks `k` experts for one token (transformers' DeepseekV2/V3TopkRouter).
fn route_token(scores: &[f32], bias: Option<&[f32]>, cfg: &MoeConfig) -> Vec<(usize, f32)> {
    let n = scores.len();
    let choice: Vec<f32> = match bias {
        Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
        None => scores.to_vec(),
    };
    // Group-limited routing: keep the experts of the `topk_group` best groups.
    let per_group = n / cfg.n_group;
    let (grouped, masked) = match cfg.router {
        Router::SigmoidGrouped => (true, f32::NEG_INFINITY),
        Router::Softmax { group_limited } => (group_limited, 0.0),
    };
    let mut allowed = vec![true; n];
    if grouped && cfg.topk_group < cfg.n_group {
        let group_score = |g: usize| {
            let mut s: Vec<f32> = choice[g * per_group..(g + 1) * per_group].to_vec();
            s.sort_by(|a, b| b.total_cmp(a));
            match cfg.router {
                Router::SigmoidGrouped => s.iter().take(2).sum::<f32>(), // sum of the top two
                Router::Softmax { .. } => s[0],                          // the best one
            }
        };
        let groups = top_k(
            &(0..cfg.n_group).map(group_score).collect::<Vec<_>>(),
            cfg.topk_group,
        );
        for (e, ok) in allowed.iter_mut().enumerate() {
            *ok = groups.contains(&(e / per_group));
        }
    }
    let masked_choice: Vec<f32> = choice
        .iter()
        .zip(&allowed)
        .map(|(&c, &ok)| if ok { c } else { masked })
        .collect();
    let chosen = top_k(&masked_choice, cfg.num_experts_per_tok);
    let mut weights: Vec<f32> = chosen
        .iter()
        .map(|&e| if allowed[e] { scores[e] } else { 0.0 })
        .collect();
    if cfg.norm_topk_prob && cfg.router == Router::SigmoidGrouped {
        let sum: f32 = weights.iter().sum::<f32>() + 1e-20;
        weights.iter_mut().for_each(|w| *w /= sum);
    }
    let scale = cfg.routed_scaling_factor as f32;
    chosen
        .into_iter()
        .zip(weights)
        .map(|(e, w)| (e, w * scale))
        .collect()
}

/// Indices of the `k` largest values, largest first.
fn top_k(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]));
    idx.truncate(k);
    idx
}

impl Module for Moe {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, h) = x.dims3()?;
        let x = x.reshape((b * t, h))?; // (N, C)
        let routes = self.route(&x)?;
        let mut out = x.zeros_like()?;
        for (e, expert) in self.experts.iter().enumerate() {
            // The tokens routed to expert e and their weights.
            let (tokens, weights): (Vec<u32>, Vec<f32>) = routes
                .iter()
                .enumerate()
                .flat_map(|(i, r)| {
                    r.iter()
                        .filter(|(ex, _)| *ex == e)
                        .map(move |(_, w)| (i as u32, *w))
                })
                .unzip();
            if tokens.is_empty() {
                continue;
            }
            let n = tokens.len();
            let idx = Tensor::from_vec(tokens, n, x.device())?;
            let w = Tensor::from_vec(weights, (n, 1), x.device())?.to_dtype(x.dtype())?;
            let y = expert
                .forward(&x.index_select(&idx, 0)?)?
                .broadcast_mul(&w)?;
            out = out.index_add(&idx, &y, 0)?;
        }
        if let Some(shared) = &self.shared_experts {
            out = (out + shared.forward(&x)?)?;
        }
        out.reshape((b, t, h))
    }
}
