//! A prompt's attention on CPU, on our pool: in one pass per piece of query rows
//! ([`attention`], `prompt/fused.rs`), or (MLA's scores, other shapes) the two products per
//! K/V group ([`products`]) and the weights in one pass per row, `softmax(scores · scale +
//! mask)` ([`masked`]); both with the decode op's vectorized exponential
//! ([`super::decode::softmax_row`]).
//!
//! Through candle's ops the products ran on one thread (its `gemm` call per group did not
//! split them: 12% of a 512-token SmolLM2 prefill on the AVX2 host, the other core idle),
//! and the weights were three ops over the whole (heads · T, S) scores (the scaling, the
//! mask's broadcast add, candle-nn's softmax), each a pass through memory, the softmax with
//! libm's `expf` per value and its rows handed to rayon's pool from outside it. SmolLM2-135M's
//! 512-token prompt makes 2.4 M scores a layer. Positions the mask hides get exactly 0, as in
//! candle's softmax.

use super::decode::softmax_row;
use crate::model::cpu::f32_rows;
use crate::model::linear::prefill::{self, Weights};
use crate::model::linear::simd::Isa;
use crate::model::pool::{each_row, Disjoint, Pool};
use candle_core::{CpuStorage, CustomOp2, DType, Error, Layout, Result, Shape, Storage, Tensor};

/// Rows of `a` per piece of work in [`products`] and of q in [`attention`].
const PRODUCT_ROWS: usize = 128;

/// `a · bᵀ` per (batch, group): a (B, G, M, K), b (B, G, N, K) -> (B, G, M, N), f32 on CPU
/// (else `None`: candle's matmul), in pieces of [`PRODUCT_ROWS`] rows of `a` over the pool
/// (each piece `prefill::product`, which runs alone inside a pool job). Only for a prompt's
/// many query rows (M > 16): it reads b contiguous, a copy of a cache view that a decode
/// step the fused op does not take (a sliding window) should not pay.
pub fn products(a: &Tensor, b: &Tensor) -> Option<Result<Tensor>> {
    let ours = a.device().is_cpu()
        && a.rank() == 4
        && a.dims()[2] > 16
        && [a, b]
            .iter()
            .all(|t| t.dtype() == DType::F32 && t.rank() == 4)
        && a.dims()[..2] == b.dims()[..2]
        && a.dim(3).ok() == b.dim(3).ok();
    ours.then(|| {
        let (bs, g, m, k) = a.dims4()?;
        let n = b.dim(2)?;
        let (a, b) = (a.contiguous()?, b.contiguous()?);
        let (sa, la) = a.storage_and_layout();
        let (sb, lb) = b.storage_and_layout();
        let (Storage::Cpu(sa), Storage::Cpu(sb)) = (&*sa, &*sb) else {
            return Err(Error::Msg("attention products: CPU operands only".into()));
        };
        let av = f32_rows(sa, la, "attention products: a")?;
        let bv = f32_rows(sb, lb, "attention products: b")?;
        let mut y = vec![0f32; bs * g * m * n];
        let (pieces, out) = (m.div_ceil(PRODUCT_ROWS).max(1), Disjoint(y.as_mut_ptr()));
        if k > 0 && m > 0 && n > 0 {
            Pool::global().run(bs * g * pieces, &|i| {
                let (head, p) = (i / pieces, i % pieces);
                let (r0, r1) = (p * PRODUCT_ROWS, ((p + 1) * PRODUCT_ROWS).min(m));
                let x = &av[(head * m + r0) * k..(head * m + r1) * k];
                let w = &bv[head * n * k..(head + 1) * n * k];
                // SAFETY: piece i alone writes rows r0..r1 of head's (M, N) block of y.
                let mine = unsafe {
                    std::slice::from_raw_parts_mut(out.at((head * m + r0) * n), (r1 - r0) * n)
                };
                prefill::product(x, k, Weights::F32(w), mine);
            });
        }
        Tensor::from_vec(y, (bs, g, m, n), a.device())
    })
}

/// One row of scores into its weights: `softmax(row · scale + mask)`, exactly 0 where the
/// mask hides.
fn weights_row(isa: Isa, row: &mut [f32], scale: f32, hide: &[f32]) {
    let total = numerators_row(isa, row, scale, hide);
    divide(row, total);
}

/// `row / total`, where some key is shown (`total > 0`); else the row stays zeros.
fn divide(row: &mut [f32], total: f32) {
    if total > 0.0 {
        row.iter_mut().for_each(|x| *x /= total);
    }
}

/// One row of scores into the numerators of its weights, `exp(row · scale + mask − max)`,
/// exactly 0 where the mask hides; returns their sum (0 or NaN where it hides every key).
fn numerators_row(isa: Isa, row: &mut [f32], scale: f32, hide: &[f32]) -> f32 {
    for (x, m) in row.iter_mut().zip(hide) {
        *x = *x * scale + m;
    }
    let (_, total) = softmax_row(isa, row, 1.0);
    for (x, m) in row.iter_mut().zip(hide) {
        if *m == f32::NEG_INFINITY {
            *x = 0.0;
        }
    }
    total
}

/// [`numerators_row`] for a row whose mask is 0 over columns `a..b` and -inf elsewhere: the
/// same values (`x·scale + 0` is `x·scale`, and the sum runs in the same lanes), with the
/// hidden columns set rather than the whole mask added and checked.
fn numerators_shown(isa: Isa, row: &mut [f32], scale: f32, (a, b): (usize, usize)) -> f32 {
    let hidden = |row: &mut [f32], x: f32| {
        row[..a].fill(x);
        row[b..].fill(x);
    };
    hidden(row, f32::NEG_INFINITY);
    let (_, total) = softmax_row(isa, row, scale);
    hidden(row, 0.0);
    total
}

/// `softmax(scores · scale + mask)` along the last dimension: scores (.., k·T, S) in rows of
/// S (k heads' T queries each), the mask (T, S) of 0 and -inf added to each T rows; f32 on
/// CPU, else `None` (candle's ops).
pub fn masked(scores: &Tensor, scale: f32, mask: &Tensor) -> Option<Result<Tensor>> {
    let ours = scores.device().is_cpu()
        && scores.dtype() == DType::F32
        && mask.dtype() == DType::F32
        && mask.rank() == 2
        && scores.dims().last() == mask.dims().last()
        && scores.rank() >= 2
        && scores.dims()[scores.rank() - 2].is_multiple_of(mask.dims()[0]);
    ours.then(|| scores.apply_op2_no_bwd(mask, &Masked(scale)))
}

struct Masked(f32);

impl CustomOp2 for Masked {
    fn name(&self) -> &'static str {
        "masked-softmax"
    }

    fn cpu_fwd(
        &self,
        ss: &CpuStorage,
        sl: &Layout,
        ms: &CpuStorage,
        ml: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let scores = f32_rows(ss, sl, "masked softmax: scores")?;
        let (mut out, mask) = (scores.to_vec(), f32_rows(ms, ml, "masked softmax: mask")?);
        let (t, s) = ml.shape().dims2()?;
        if out.is_empty() {
            return Ok((CpuStorage::F32(out), sl.shape().clone()));
        }
        if s == 0 || t == 0 || !out.len().is_multiple_of(t * s) {
            return Err(Error::Msg(format!(
                "masked softmax: scores {:?} are not rows of the mask {:?}",
                sl.dims(),
                ml.dims()
            )));
        }
        let (isa, scale) = (Isa::current(), self.0);
        each_row(&mut out, s, |r, row| {
            weights_row(isa, row, scale, &mask[r % t * s..][..s])
        });
        Ok((CpuStorage::F32(out), sl.shape().clone()))
    }
}

mod fused;
pub use fused::attention;

#[cfg(test)]
mod tests;
