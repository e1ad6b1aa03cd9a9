//! A prompt's attention on CPU, on our pool: the two products per K/V group ([`products`])
//! and the weights in one pass per row, `softmax(scores · scale + mask)` ([`masked`]), with
//! the decode op's vectorized exponential ([`super::decode::softmax_row`]).
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

/// Rows of `a` per piece of work in [`products`].
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

/// Causal (or windowed) attention of a prompt in one pass per piece of [`PRODUCT_ROWS`]
/// query rows: their scores against the keys any of them sees (from the first column the
/// mask shows one of them to the last), the weights in place, and their sum of `v`, the
/// scores never leaving a pool thread's buffer. q (B, G, R, Dk) with R = H/G·T rows (each
/// group's heads, T queries each), k (B, G, S, Dk), v (B, G, S, Dv), the mask (T, S) of 0
/// and -inf, f32 on CPU (else `None`: [`products`], [`masked`] and [`products`] again).
/// Returns (B, G, R, Dv).
///
/// Against those three passes over the whole (R, S) scores, a causal prompt's pieces skip
/// the keys after their last query (3/8 of the products at 512 tokens in pieces of 128)
/// and the copies of V transposed and of the scores (SmolLM2-135M's 512-token prompt: 9.4 MB
/// of scores a layer, written, copied and read again).
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
    mask: &Tensor,
) -> Option<Result<Tensor>> {
    let f32_cpu = |t: &&Tensor| t.dtype() == DType::F32 && t.device().is_cpu();
    let ours = [q, k, v, mask].iter().all(f32_cpu)
        && [q, k, v].iter().all(|t| t.rank() == 4)
        && mask.rank() == 2
        && q.dims()[2] > 16
        && q.dims()[..2] == k.dims()[..2]
        && k.dims()[..3] == v.dims()[..3]
        && q.dim(3).ok() == k.dim(3).ok()
        && mask.dim(1).ok() == k.dim(2).ok()
        && mask
            .dim(0)
            .is_ok_and(|t| t > 0 && q.dims()[2].is_multiple_of(t));
    ours.then(|| attention_f32(q, k, v, scale, mask))
}

/// [`attention`] once its operands are checked.
fn attention_f32(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32, mask: &Tensor) -> Result<Tensor> {
    let (bs, g, r, dk) = q.dims4()?;
    let (s, dv, t) = (k.dim(2)?, v.dim(3)?, mask.dim(0)?);
    let (q, k, v, mask) = (
        q.contiguous()?,
        k.contiguous()?,
        v.contiguous()?,
        mask.contiguous()?,
    );
    let guards = [&q, &k, &v, &mask].map(|t| t.storage_and_layout());
    let rows = |i: usize, what: &str| match &*guards[i].0 {
        Storage::Cpu(c) => f32_rows(c, guards[i].1, what),
        _ => Err(Error::Msg(format!(
            "prompt attention: {what} is not on the CPU"
        ))),
    };
    let (qv, kv, vv) = (rows(0, "q")?, rows(1, "k")?, rows(2, "v")?);
    let hide = rows(3, "the mask")?;
    // The columns each mask row shows: from its first 0 to its last (none: an empty range).
    let shown: Vec<(usize, usize)> = hide
        .chunks_exact(s)
        .map(|m| {
            let seen = |x: &&f32| **x != f32::NEG_INFINITY;
            let first = m.iter().position(|x| seen(&x)).unwrap_or(s);
            let last = m.iter().rposition(|x| seen(&x)).map_or(first, |l| l + 1);
            (first, last)
        })
        .collect();
    let mut y = vec![0f32; bs * g * r * dv];
    let (pieces, out, isa) = (
        r.div_ceil(PRODUCT_ROWS),
        Disjoint(y.as_mut_ptr()),
        Isa::current(),
    );
    Pool::global().run(bs * g * pieces, &|i| {
        let (head, p) = (i / pieces, i % pieces);
        let (r0, r1) = (p * PRODUCT_ROWS, ((p + 1) * PRODUCT_ROWS).min(r));
        let (c0, c1) = (r0..r1)
            .map(|row| shown[row % t])
            .fold((s, 0), |(a, b), (f, l)| (a.min(f), b.max(l)));
        if c0 >= c1 {
            return; // no row of the piece sees a key: its sums stay 0, as `masked` gives
        }
        let n = c1 - c0;
        SCORES.with_borrow_mut(|scores| {
            scores.clear();
            scores.resize((r1 - r0) * n, 0.0);
            let x = &qv[(head * r + r0) * dk..(head * r + r1) * dk];
            let keys = &kv[(head * s + c0) * dk..(head * s + c1) * dk];
            prefill::product(x, dk, Weights::F32(keys), scores);
            for (j, row) in scores.chunks_exact_mut(n).enumerate() {
                let m = &hide[(r0 + j) % t * s + c0..][..n];
                weights_row(isa, row, scale, m);
            }
            // SAFETY: piece i alone writes rows r0..r1 of head's (R, Dv) block of y; the
            // scores are (r1 - r0) × n, and v's rows c0..c1 of this head are Dv wide.
            unsafe {
                let values = vv.as_ptr().add((head * s + c0) * dv);
                prefill::gemm_block(
                    r1 - r0,
                    (dv, n),
                    (scores.as_ptr(), n),
                    (values, 1, dv),
                    out.at((head * r + r0) * dv),
                    dv,
                    false,
                );
            }
        });
    });
    drop(guards);
    Tensor::from_vec(y, (bs, g, r, dv), q.device())
}

thread_local! {
    /// A pool thread's scores of one piece of [`attention`].
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// One row of scores into its weights: `softmax(row · scale + mask)`, exactly 0 where the
/// mask hides.
fn weights_row(isa: Isa, row: &mut [f32], scale: f32, hide: &[f32]) {
    for (x, m) in row.iter_mut().zip(hide) {
        *x = *x * scale + m;
    }
    let (_, total) = softmax_row(isa, row, 1.0);
    for (x, m) in row.iter_mut().zip(hide) {
        *x = if *m == f32::NEG_INFINITY {
            0.0
        } else {
            *x / total
        };
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::attention::causal_mask;
    use candle_core::Device;

    /// Against candle's three ops: 2 groups of 3 heads' 5 queries over 9 keys, causal and
    /// with a sliding window of 3; hidden positions exactly 0.
    #[test]
    fn masked_softmax_matches_candle_ops() -> Result<()> {
        let dev = Device::Cpu;
        let scores = Tensor::randn(0f32, 3.0, (1, 2, 3 * 5, 9), &dev)?;
        for window in [usize::MAX, 3] {
            let mask = causal_mask(5, 9, window, DType::F32, &dev)?;
            let got = masked(&scores, 0.125, &mask).expect("taken")?;
            let want = (scores.reshape((1, 2, 3, 5, 9))? * 0.125)?.broadcast_add(&mask)?;
            let want = candle_nn::ops::softmax_last_dim(&want)?.reshape((1, 2, 15, 9))?;
            let diff = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-6, "window {window}: {diff}");
            let hidden = mask.broadcast_as((1, 2, 3, 5, 9))?.reshape((1, 2, 15, 9))?;
            let (got, hidden) = (
                got.flatten_all()?.to_vec1::<f32>()?,
                hidden.flatten_all()?.to_vec1::<f32>()?,
            );
            assert!(got.iter().zip(&hidden).all(|(g, m)| *m == 0.0 || *g == 0.0));
        }
        Ok(())
    }

    /// The fused pass against the three it replaces: 2 batches of 2 groups of 2 heads' 150
    /// queries (pieces of 128 rows across the heads' boundary), Dk 24 and Dv 20; the queries
    /// after 0 or 40 cached positions, causal and with a sliding window of 37.
    #[test]
    fn fused_attention_matches_the_three_passes() -> Result<()> {
        let dev = Device::Cpu;
        let (t, dk, dv) = (150, 24, 20);
        for (cached, window) in [(0, usize::MAX), (40, usize::MAX), (40, 37)] {
            let s = cached + t;
            let q = Tensor::randn(0f32, 1.0, (2, 2, 2 * t, dk), &dev)?;
            let k = Tensor::randn(0f32, 1.0, (2, 2, s, dk), &dev)?;
            let v = Tensor::randn(0f32, 1.0, (2, 2, s, dv), &dev)?;
            let mask = causal_mask(t, s, window, DType::F32, &dev)?;
            let got = attention(&q, &k, &v, 0.2, &mask).expect("taken")?;
            let scores = products(&q, &k).expect("taken")?;
            let weights = masked(&scores, 0.2, &mask).expect("taken")?;
            let want = products(&weights, &v.transpose(2, 3)?).expect("taken")?;
            let diff = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-5, "{cached} cached, window {window}: {diff}");
        }
        Ok(())
    }

    /// Against candle's matmul: 2 batches of 3 groups, 300 rows (pieces of 128 and a tail),
    /// b a strided view (a transpose), K = 40.
    #[test]
    fn products_match_candle_matmul() -> Result<()> {
        let dev = Device::Cpu;
        let a = Tensor::randn(0f32, 1.0, (2, 3, 300, 40), &dev)?;
        let b = Tensor::randn(0f32, 1.0, (2, 3, 40, 77), &dev)?.transpose(2, 3)?;
        let got = products(&a, &b).expect("taken")?;
        let want = a.matmul(&b.t()?)?;
        let diff = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-4, "{diff}");
        Ok(())
    }
}
