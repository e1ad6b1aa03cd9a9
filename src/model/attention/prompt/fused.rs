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
//!
//! Over a bf16 cache where the CPU multiplies bf16 pairs (AVX-512 BF16), q (rounded to bf16),
//! k and v are read as bf16 and both products run on the decode op's pair kernel
//! (`decode::keys` and `decode::pairs`: 16 keys transposed in registers, two positions'
//! values per `vdpbf16ps`), the weights rounded to bf16 for the values as the decode op
//! rounds them (its numerators, divided by their sum after); elsewhere they are widened to
//! f32 first (`sdpa`). SmolLM2-135M bf16, a 3000-token prompt (Zen 4, 2 threads): 608-630
//! -> 709-732 tok/s.

use super::{divide, numerators_row, numerators_shown, PRODUCT_ROWS};
use crate::model::attention::decode;
#[cfg(target_arch = "x86_64")]
use crate::model::attention::decode::pairs;
use crate::model::cpu::f32_rows;
use crate::model::linear::prefill::{self, Weights};
use crate::model::linear::simd::{self, Isa};
use crate::model::pool::{Disjoint, Pool};
use candle_core::{CpuStorage, DType, Error, Result, Storage, Tensor};
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
    let cpu = [q, k, v, mask].iter().all(|t| t.device().is_cpu());
    let all = |dtype: DType| [q, k, v].iter().all(|t| t.dtype() == dtype);
    let ours = cpu
        && mask.dtype() == DType::F32
        && (all(DType::F32) || (all(DType::BF16) && pairs()))
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

/// Whether the CPU multiplies bf16 pairs, so that bf16 operands are read as they are.
fn pairs() -> bool {
    simd::bf16_pairs(Isa::current())
}

/// q, k and v as rows: f32, or bf16 (raw bits) where the CPU multiplies bf16 pairs.
enum Rows<'a> {
    F32 {
        q: &'a [f32],
        k: &'a [f32],
        v: &'a [f32],
    },
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // made only on x86
    Bf16 {
        q: &'a [u16],
        k: &'a [u16],
        v: &'a [u16],
    },
}

/// What a piece reads: the operands as rows, their sizes, and the columns each mask row
/// shows.
struct Operands<'a> {
    rows: Rows<'a>,
    hide: &'a [f32],
    /// Per mask row: the columns from its first 0 to its last (none: an empty range).
    shown: Vec<(usize, usize)>,
    /// Per mask row: some column shown, and 0 in every shown column (a causal or sliding
    /// window's mask), so that its weights need only the hidden columns set, not the whole
    /// mask added.
    plain: Vec<bool>,
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
    let cpu = |i: usize, what: &str| match &*guards[i].0 {
        Storage::Cpu(c) => Ok(c),
        _ => Err(Error::Msg(format!(
            "prompt attention: {what} is not on the CPU"
        ))),
    };
    let rows = |i: usize, what: &str| f32_rows(cpu(i, what)?, guards[i].1, what);
    let bits = |i: usize, what: &str| match (cpu(i, what)?, guards[i].1.contiguous_offsets()) {
        (CpuStorage::BF16(x), Some((a, b))) => Ok(decode::bits(&x[a..b])),
        _ => Err(Error::Msg(format!(
            "prompt attention: {what} is not contiguous bf16"
        ))),
    };
    let hide = rows(3, "the mask")?;
    let seen = |x: &f32| *x != f32::NEG_INFINITY;
    let shown: Vec<(usize, usize)> = hide
        .chunks_exact(s)
        .map(|m| {
            let first = m.iter().position(seen).unwrap_or(s);
            (first, m.iter().rposition(seen).map_or(first, |l| l + 1))
        })
        .collect();
    let plain = (hide.chunks_exact(s).zip(&shown))
        // Without an early exit, so that the compare vectorizes (a plain row has none).
        .map(|(m, &(a, b))| a < b && m[a..b].iter().fold(true, |all, &x| all & (x == 0.0)))
        .collect();
    let rows = match q.dtype() {
        // Checked again here, not only by `attention`'s gate: `Rows::Bf16` is the promise
        // the pair kernels run on this CPU.
        DType::BF16 if pairs() => Rows::Bf16 {
            q: bits(0, "q")?,
            k: bits(1, "k")?,
            v: bits(2, "v")?,
        },
        _ => Rows::F32 {
            q: rows(0, "q")?,
            k: rows(1, "k")?,
            v: rows(2, "v")?,
        },
    };
    let ops = Operands {
        rows,
        hide,
        shown,
        plain,
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
    /// A pool thread's bf16 keys of one piece, transposed.
    static KEYS_T: RefCell<Vec<u16>> = const { RefCell::new(Vec::new()) };
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
    let (queries, keys) = (
        (head * o.r + r0) * dk..(head * o.r + r1) * dk,
        (head * s + c0) * dk,
    );
    let values = (head * s + c0) * dv..(head * s + c1) * dv;
    let mut totals = vec![0f32; r1 - r0];
    SCORES.with_borrow_mut(|scores| {
        // Every product below writes each score (none adds to it): no zeros first.
        let need = (r1 - r0) * n;
        if scores.len() < need {
            scores.resize(need, 0.0);
        }
        let scores = &mut scores[..need];
        match o.rows {
            Rows::F32 { q, k, .. } => {
                let keys = &k[keys..keys + n * dk];
                prefill::product(&q[queries], dk, Weights::F32(keys), scores)
            }
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Rows::Bf16` is made only where the CPU multiplies bf16 pairs.
            Rows::Bf16 { q, k, .. } => unsafe { scores_bf16(&q[queries], &k[keys..], n, scores) },
            #[cfg(not(target_arch = "x86_64"))]
            Rows::Bf16 { .. } => unreachable!("bf16 pairs are x86's"),
        }
        // Row j's numerators, exp(row · scale + mask − max), and their sum.
        let numerators = |j: usize, row: &mut [f32]| {
            let m = (r0 + j) % t;
            match o.plain[m] {
                true => {
                    let (a, b) = o.shown[m];
                    numerators_shown(isa, row, scale, (a - c0, b - c0))
                }
                false => numerators_row(isa, row, scale, &o.hide[m * s + c0..][..n]),
            }
        };
        match o.rows {
            Rows::F32 { .. } => {
                for (j, row) in scores.chunks_exact_mut(n).enumerate() {
                    let total = numerators(j, row);
                    divide(row, total);
                }
            }
            // The numerators only, divided by their sums after the values, as the decode op
            // divides its own: the two round the same weights to bf16.
            Rows::Bf16 { .. } => {
                for (j, row) in scores.chunks_exact_mut(n).enumerate() {
                    totals[j] = numerators(j, row);
                }
            }
        }
        match o.rows {
            // SAFETY: the scores are (r1 - r0) × n; v's rows c0..c1 of this head are Dv wide,
            // read as the columns of vᵀ (stride 1 between its rows, Dv between its columns);
            // y is the caller's.
            Rows::F32 { v, .. } => unsafe {
                prefill::gemm_block(
                    r1 - r0,
                    (dv, n),
                    (scores.as_ptr(), n),
                    (v[values].as_ptr(), 1, dv),
                    y,
                    dv,
                    false,
                )
            },
            // SAFETY: y is the caller's (r1 - r0) × Dv values, zero until now; the CPU
            // multiplies bf16 pairs (as above).
            #[cfg(target_arch = "x86_64")]
            Rows::Bf16 { v, .. } => unsafe {
                let y = std::slice::from_raw_parts_mut(y, (r1 - r0) * dv);
                pairs::accumulate(isa, scores, &v[values], (dv, dv), y);
                for (row, &total) in y.chunks_exact_mut(dv).zip(&totals) {
                    divide(row, total);
                }
            },
            #[cfg(not(target_arch = "x86_64"))]
            Rows::Bf16 { .. } => unreachable!("bf16 pairs are x86's"),
        }
    });
}

/// `scores (M, n) = q (M, Dk) · kᵀ` for bf16 q and the first n keys of `k` (raw bits, rows
/// of Dk): on the decode op's score kernel ([`decode::keys`], 16 keys transposed in
/// registers, each lane one key), the same sums as a decode step's. Keys of other widths
/// are transposed in memory, each of their Dk columns a row of n, so that the pair kernel
/// of the decode op's value sum ([`pairs`]) makes the scores with q's rows as its weights
/// (two key columns a `vdpbf16ps`, in the same order). That transpose in memory, a store
/// per value n apart, cost more than the register transposes redone for each 16 query
/// rows: SmolLM2 bf16 (Zen 4, alternating runs) `mla:64,rope=64` prefilled 2000 tokens at
/// 695-716 -> 761-771 tok/s and 6000 at 372-383 -> 463-471, the original 6000 at 496-502
/// -> 511-549 (2000 even).
///
/// # Safety
/// The CPU multiplies bf16 pairs (`simd::bf16_pairs`).
#[cfg(target_arch = "x86_64")]
unsafe fn scores_bf16(q: &[u16], k: &[u16], n: usize, scores: &mut [f32]) {
    let dk = q.len() / (scores.len() / n);
    if decode::keys::takes(dk) {
        // SAFETY: the caller's contract; `scores` holds q's rows of n.
        return unsafe { decode::keys::scores(q, dk, &k[..n * dk], scores.as_mut_ptr(), n) };
    }
    KEYS_T.with_borrow_mut(|kt| {
        kt.clear();
        kt.resize(dk * n, 0);
        for (j, key) in k[..n * dk].chunks_exact(dk).enumerate() {
            for (i, &x) in key.iter().enumerate() {
                kt[i * n + j] = x;
            }
        }
        // The pair kernel adds to the scores.
        scores.fill(0.0);
        // SAFETY: the caller's contract.
        unsafe { pairs::accumulate_bits(q, kt, (n, n), scores) }
    });
}
