//! The end-to-end training's loss from the last hidden states, through the frozen head, in
//! one op on the CPU: [`super::frozen::grouped_cross_entropy`] of `h·headᵀ`, its gradient
//! with respect to h computed in the same pass.
//!
//! Why: in candle's basic ops the logits of a step (1024 positions × SmolLM2's 49,152 tokens,
//! 200 MB) and a dozen tensors of their size (log-softmax, its backward) are each a fresh
//! allocation that the kernel zeroes page by page, and a pass of their own. Here the logits
//! are made [`ROWS`] positions at a time in one buffer on our kernels (the AVX-512 tile reads
//! the head once per 64 rows), turned into the loss and, in place, into its gradient
//! (softmax · (P − c·S), plus c·s − q at the top tokens: [`position`]), which one more
//! product takes back to h. The backward only scales what the forward kept.

use super::frozen::{grouped_cross_entropy, REST_FLOOR};
use super::product::{in_place, Weight};
use crate::model::attention::decode::softmax_row;
use crate::model::linear::matvec::{rows_f32, slice};
use crate::model::linear::simd::Isa;
use crate::model::pool::{each_row, Disjoint};
use candle_core::{CpuStorage, CustomOp1, Error, Layout, Result, Shape, Tensor};
use std::sync::Mutex;

/// Positions whose logits are made at once, at most: fewer where a chunk's logits would
/// pass [`CHUNK_BYTES`] (SmolLM2's 49,152 tokens: 128 rows, 25 MB).
const ROWS: usize = 128;
/// Under the 32 MiB mmap threshold `main.rs` gives glibc, so the buffer comes from the
/// heap, reused, rather than mapped (and zeroed by the kernel) afresh each step.
const CHUNK_BYTES: usize = 30 << 20;

/// The frozen head (V, C), with its transpose where our kernels run the fused op.
pub struct Head(Weight);

impl Head {
    pub fn new(w: Tensor) -> crate::error::Result<Self> {
        Ok(Self(Weight::new(w)?))
    }

    /// The mean over positions of the grouped cross-entropy of the original's top tokens
    /// `top` (N, K) with probabilities `p` against the logits `h·wᵀ` for h (N, C).
    pub fn loss(&self, h: &Tensor, top: &Tensor, p: &Tensor) -> crate::error::Result<Tensor> {
        let ours = h.device().is_cpu() && h.dtype() == candle_core::DType::F32;
        let (Some(t), true) = (self.0.transposed(), ours) else {
            return grouped_cross_entropy(&self.0.product(h)?, top, p);
        };
        let op = HeadLoss {
            w: self.0.w.clone(),
            t: t.clone(),
            top: top.flatten_all()?.to_vec1::<u32>()?,
            p: p.flatten_all()?.to_vec1::<f32>()?,
            k: top.dim(1)?,
            want_grad: h.track_op(),
            grad: Mutex::new(None),
        };
        Ok(h.contiguous()?.apply_op1(op)?)
    }
}

struct HeadLoss {
    /// The head (V, C) and its transpose (C, V).
    w: Tensor,
    t: Tensor,
    /// Per position, the original's top `k` tokens (N·k) and their probabilities (N·k).
    top: Vec<u32>,
    p: Vec<f32>,
    k: usize,
    /// Whether h is trained (the held-out scores are not): only then the gradient is made.
    want_grad: bool,
    /// d loss / d h, made by the forward for the backward.
    grad: Mutex<Option<Tensor>>,
}

impl CustomOp1 for HeadLoss {
    fn name(&self) -> &'static str {
        "head-cross-entropy"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(h) = s else {
            return Err(Error::Msg("head loss: h not f32".into()));
        };
        let h = slice(h, l, "head loss: h")?;
        let (v, c) = self.w.dims2()?;
        let (n, hc) = l.shape().dims2()?;
        let k = self.k;
        if hc != c || self.top.len() != n * k || self.p.len() != n * k {
            return Err(Error::Msg(format!(
                "head loss: h {:?}, {} top tokens for {k} a position, head {v}x{c}",
                l.shape(),
                self.top.len()
            )));
        }
        if let Some(bad) = self.top.iter().find(|&&i| i as usize >= v) {
            return Err(Error::Msg(format!(
                "head loss: top token {bad} outside the vocabulary of {v}"
            )));
        }
        let isa = Isa::current();
        let chunk = (CHUNK_BYTES / (4 * v).max(1)).clamp(1, ROWS);
        let mut losses = vec![0f32; n];
        let mut grad = vec![0f32; if self.want_grad { n * c } else { 0 }];
        let mut z = vec![0f32; chunk.min(n) * v];
        in_place(&self.w, |w| {
            in_place(&self.t, |t| {
                for r0 in (0..n).step_by(chunk) {
                    let rows = chunk.min(n - r0);
                    let z = &mut z[..rows * v];
                    rows_f32(&h[r0 * c..(r0 + rows) * c], c, w, z);
                    let out = Disjoint(losses[r0..].as_mut_ptr());
                    each_row(z, v, |r, row| {
                        let at = (r0 + r) * k;
                        let (top, q) = (&self.top[at..at + k], &self.p[at..at + k]);
                        // SAFETY: row r alone writes losses[r0 + r], inside `losses`.
                        unsafe { *out.at(r) = position(isa, row, top, q, n) };
                    });
                    if self.want_grad {
                        rows_f32(z, v, t, &mut grad[r0 * c..(r0 + rows) * c]);
                    }
                }
            })
        })??;
        if self.want_grad {
            let g = Tensor::from_vec(grad, (n, c), &candle_core::Device::Cpu)?;
            *self.grad.lock().unwrap_or_else(|e| e.into_inner()) = Some(g);
        }
        let mean = losses.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
        Ok((CpuStorage::F32(vec![mean as f32]), Shape::from(())))
    }

    fn bwd(&self, _h: &Tensor, _loss: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        // Cloned, not taken: a second backward through the same graph gets it again.
        let mine = self.grad.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let g = mine.ok_or_else(|| Error::Msg("head loss: no gradient kept".into()))?;
        Ok(Some(g.broadcast_mul(grad)?))
    }
}

/// One position: its logits `row` in, `-Σ q log s_top − q_rest log(s_rest + floor)` out
/// (s the softmax, q the original's `p` at `top`), and `row` replaced by that loss's
/// gradient divided by `n`, the loss being the mean over n positions. With S = Σ s_top,
/// P = Σ q and c = q_rest / (1 − S + floor) (0 where 1 − S < 0, as the relu gives; at
/// exactly 0 candle's relu passes the gradient, this takes it as 0, a rounding apart):
/// ∂/∂z_j = s_j·(P − c·S) − Σ_{k: top_k = j} (q_k − c·s_j).
fn position(isa: Isa, row: &mut [f32], top: &[u32], q: &[f32], n: usize) -> f32 {
    let picked: Vec<f32> = top.iter().map(|&i| row[i as usize]).collect();
    let (max, total) = softmax_row(isa, row, 1.0);
    let ln_total = (total as f64).ln();
    let s: Vec<f64> = top
        .iter()
        .map(|&i| (row[i as usize] / total) as f64)
        .collect();
    let (mut cross, mut sum_s, mut sum_q) = (0f64, 0f64, 0f64);
    for ((&z, &q), &s) in picked.iter().zip(q).zip(&s) {
        cross += q as f64 * ((z - max) as f64 - ln_total);
        sum_s += s;
        sum_q += q as f64;
    }
    let rest_q = (1.0 - sum_q).max(0.0);
    let rest_s = (1.0 - sum_s).max(0.0);
    cross += rest_q * (rest_s + REST_FLOOR).ln();
    let c = match 1.0 - sum_s > 0.0 {
        true => rest_q / (rest_s + REST_FLOOR),
        false => 0.0,
    };
    let scale = ((sum_q - c * sum_s) / (total as f64 * n as f64)) as f32;
    row.iter_mut().for_each(|x| *x *= scale);
    for ((&i, &q), &s) in top.iter().zip(q).zip(&s) {
        row[i as usize] += ((c * s - q as f64) / n as f64) as f32;
    }
    -cross as f32
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// The fused op against candle's ops on the same logits: the loss and h's gradient, over
    /// positions that are not a multiple of [`ROWS`], top tokens that leave the rest little
    /// or much, and a vocabulary not a multiple of a register.
    #[test]
    fn the_fused_loss_and_gradient_are_candles() -> Result<()> {
        let cpu = &Device::Cpu;
        let (n, c, v, k) = (ROWS + 37, 24, 1003, 8);
        let head = Head::new(Tensor::randn(0f32, 0.5, (v, c), cpu)?).map_err(Error::wrap)?;
        if head.0.transposed().is_none() {
            eprintln!("SKIPPED: no fused head loss with this CPU's kernels");
            return Ok(());
        }
        let h = Var::from_tensor(&Tensor::randn(0f32, 1.0, (n, c), cpu)?)?;
        // Each position's top tokens: distinct, scattered; probabilities summing to 0.3-0.99.
        let top: Vec<u32> = (0..n * k)
            .map(|i| ((i / k * 131 + i % k * 97) % v) as u32)
            .collect();
        let p: Vec<f32> = (0..n * k)
            .map(|i| (0.3 + 0.69 * ((i / k) % 7) as f32 / 6.0) / k as f32)
            .collect();
        let top = Tensor::from_vec(top, (n, k), cpu)?;
        let p = Tensor::from_vec(p, (n, k), cpu)?;
        let run = |f: &dyn Fn(&Tensor) -> Result<Tensor>| -> Result<(f32, Tensor)> {
            let loss = f(h.as_tensor())?;
            let grads = (&loss * 3.0)?.backward()?;
            let g = grads.get(h.as_tensor()).expect("h's gradient").clone();
            Ok((loss.to_scalar::<f32>()?, g))
        };
        let (want, want_g) = run(&|h| {
            grouped_cross_entropy(&h.matmul(&head.0.w.t()?)?, &top, &p).map_err(Error::wrap)
        })?;
        let (got, got_g) = run(&|h| head.loss(h, &top, &p).map_err(Error::wrap))?;
        let err = (&got_g - &want_g)?.abs()?.max_all()?.to_scalar::<f32>()?;
        let size = want_g.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(
            (got - want).abs() < 1e-4 * want.abs(),
            "{got} against {want}"
        );
        assert!(err < 1e-3 * size, "gradient off by {err} (largest {size})");
        Ok(())
    }
}
