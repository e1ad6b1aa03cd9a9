//! A prompt's causal (or windowed) attention in one pass per piece of [`PRODUCT_ROWS`] query
//! rows: their scores against the keys any of them sees (from the first column the mask
//! shows one of them to the last), the weights in place, and their sum of `v`, the scores
//! never leaving a pool thread's buffer.
//!
//! Against the three passes it replaces over the whole (R, S) scores ([`super::products`],
//! [`super::masked`], [`super::products`] of the weights and `v` transposed), a causal
//! prompt's pieces skip the keys after their last query (3/8 of the products at 512
//! tokens in pieces of 128), and neither the scores (SmolLM2-135M's 512-token prompt: 9.4 MB
//! a layer, written, copied and read again) nor `v` transposed are copied. (Zen 5, 2
//! threads, SmolLM2-135M's 512-token prompt, 3 alternating runs: Q4_0 1067-1086 -> 1250-1301
//! tok/s, Q8_0 957-1001 -> 1153-1166.)

use super::{weights_row, PRODUCT_ROWS};
use crate::model::cpu::f32_rows;
use crate::model::linear::prefill::{self, Weights};
use crate::model::linear::simd::Isa;
use crate::model::pool::{Disjoint, Pool};
use candle_core::{DType, Error, Result, Storage, Tensor};
use std::cell::RefCell;

/// `softmax(q · kᵀ · scale + mask) · v` per group: q (B, G, R, Dk) with R = H/G·T rows (each
/// group's heads, T queries each), k (B, G, S, Dk), v (B, G, S, Dv), the mask (T, S) of 0 and
/// -inf; f32 on CPU, S > 0 and more than 16 query rows, else `None` (the three passes).
/// Returns (B, G, R, Dv); a row the mask hides every key from gets zeros, as
/// [`super::masked`] gives it.
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
        && k.dim(2).is_ok_and(|s| s > 0)
        && mask.dim(1).ok() == k.dim(2).ok()
        && mask
            .dim(0)
            .is_ok_and(|t| t > 0 && q.dims()[2].is_multiple_of(t));
    ours.then(|| checked(q, k, v, scale, mask))
}

/// What a piece reads: the operands as rows, their sizes, and the columns each mask row
/// shows.
struct Operands<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    hide: &'a [f32],
    /// Per mask row: the columns from its first 0 to its last (none: an empty range).
    shown: Vec<(usize, usize)>,
    /// Query rows per group (R), keys (S), mask rows (T), Dk, Dv.
    r: usize,
    s: usize,
    t: usize,
    dk: usize,
    dv: usize,
}

/// [`attention`] once its operands are checked.
fn checked(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32, mask: &Tensor) -> Result<Tensor> {
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
    let hide = rows(3, "the mask")?;
    let seen = |x: &f32| *x != f32::NEG_INFINITY;
    let shown = hide
        .chunks_exact(s)
        .map(|m| {
            let first = m.iter().position(seen).unwrap_or(s);
            (first, m.iter().rposition(seen).map_or(first, |l| l + 1))
        })
        .collect();
    let ops = Operands {
        q: rows(0, "q")?,
        k: rows(1, "k")?,
        v: rows(2, "v")?,
        hide,
        shown,
        r,
        s,
        t,
        dk,
        dv,
    };
    let mut y = vec![0f32; bs * g * r * dv];
    let (pieces, out, isa) = (
        r.div_ceil(PRODUCT_ROWS),
        Disjoint(y.as_mut_ptr()),
        Isa::current(),
    );
    Pool::global().run(bs * g * pieces, &|i| {
        let (head, p) = (i / pieces, i % pieces);
        let rows = (p * PRODUCT_ROWS, ((p + 1) * PRODUCT_ROWS).min(r));
        // SAFETY: piece i alone writes rows r0..r1 of head's (R, Dv) block of y.
        unsafe {
            piece(
                &ops,
                head,
                rows,
                isa,
                scale,
                out.at((head * r + rows.0) * dv),
            )
        };
    });
    drop(guards);
    Tensor::from_vec(y, (bs, g, r, dv), q.device())
}

thread_local! {
    /// A pool thread's scores of one piece.
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Query rows `r0..r1` of (batch × group) `head`: their weighted sums of `v`, at `y`.
///
/// # Safety
/// `y` is valid for writes of (r1 - r0) × Dv values that nothing else touches meanwhile.
unsafe fn piece(
    o: &Operands,
    head: usize,
    (r0, r1): (usize, usize),
    isa: Isa,
    scale: f32,
    y: *mut f32,
) {
    let (s, t, dk, dv) = (o.s, o.t, o.dk, o.dv);
    let (c0, c1) = (r0..r1)
        .map(|row| o.shown[row % t])
        .fold((s, 0), |(a, b), (f, l)| (a.min(f), b.max(l)));
    if c0 >= c1 {
        return; // no row of the piece sees a key: its sums stay 0, as `masked` gives
    }
    let n = c1 - c0;
    SCORES.with_borrow_mut(|scores| {
        scores.clear();
        scores.resize((r1 - r0) * n, 0.0);
        let x = &o.q[(head * o.r + r0) * dk..(head * o.r + r1) * dk];
        let keys = &o.k[(head * s + c0) * dk..(head * s + c1) * dk];
        prefill::product(x, dk, Weights::F32(keys), scores);
        for (j, row) in scores.chunks_exact_mut(n).enumerate() {
            weights_row(isa, row, scale, &o.hide[(r0 + j) % t * s + c0..][..n]);
        }
        // SAFETY: the scores are (r1 - r0) × n; v's rows c0..c1 of this head are Dv wide,
        // read as the columns of vᵀ (stride 1 between its rows, Dv between its columns);
        // y is the caller's.
        unsafe {
            prefill::gemm_block(
                r1 - r0,
                (dv, n),
                (scores.as_ptr(), n),
                (o.v.as_ptr().add((head * s + c0) * dv), 1, dv),
                y,
                dv,
                false,
            )
        };
    });
}
