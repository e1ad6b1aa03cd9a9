//! Attention for one new token, the whole of it in one candle op on CPU: scores, softmax and
//! the weighted sum of values, read straight from the cache views, in f32 (on AVX-512 BF16
//! a bf16 cache's keys meet the query rounded to bf16, as bf16 pairs: [`query`]; and its
//! values the softmax weights rounded to bf16, as transformers' bf16 attention rounds them:
//! `pairs`).
//!
//! Through candle's ops this step is ten tensor ops per layer, and its small batched matmuls
//! read the cache far below the memory bandwidth (decode at 2k positions ran at half the
//! speed of decode at 32). Here the positions are split into blocks that the [`Pool`] runs
//! in parallel ("flash decoding"): each block gives, for every query head of its K/V head, a
//! running max, a sum of exponentials and an unnormalised sum of values, and the blocks are
//! merged at the end. Scores use the [`simd`] matrix kernel (the group's query heads are the
//! rows of x, the cached keys the rows of W); the value sum is `accumulate`.
//!
//! A paged cache (`serve`'s pool, [`crate::kv_cache::Pages`]) is read through its block
//! table: each block of positions is a few runs of adjacent pool rows, scored into one row
//! of scores per head and summed run by run, with no copy of the keys or values.
//!
//! Over 300 lines on purpose: one candle op, whose blocks, merge and f32/bf16 cache reads
//! only make sense together; the NEON forms are in `arm`.

use crate::kv_cache::Pages;
use crate::model::linear::simd::{self, Isa, IsaKind};
use crate::model::pool::{Disjoint, Pool};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Error, Layout, Result, Shape};
use half::bf16;
use query::{Queries, Query};
use std::slice::from_raw_parts_mut;

/// Cached positions per block, at least: enough work per block to pay for the hand-off.
const BLOCK: usize = 256;
/// And at most: a block's keys and values (2 × 1024 × 128 × 4 bytes for the usual head
/// sizes) stay in L2 between the scores and the value sum.
const MAX_BLOCK: usize = 1024;

// A block of this op is whole blocks of a paged cache.
const _: () = assert!(BLOCK.is_multiple_of(crate::kv_cache::BLOCK));
// A pool block's rows are whole bf16 pairs (`pairs`), so that a paged run adds its rows as
// the same rows in one run do (bit for bit).
const _: () = assert!(crate::kv_cache::BLOCK.is_multiple_of(2));
const _: () = assert!(MAX_BLOCK.is_multiple_of(BLOCK));

/// The block length for one head's `len` positions: a quarter of them (for 2-4 threads'
/// work per head), in whole [`BLOCK`]s, from [`BLOCK`] to [`MAX_BLOCK`]. Each block starts a
/// stream of the cache's rows and its own partial softmax: SmolLM2-135M Q8_0 at 6000
/// positions (Zen 4, 2 threads, 4 alternating rounds, medians), against blocks of 256 GQA
/// 9/3 decodes at 89.6 -> 100.2 tok/s (its cache read at its bandwidth), `mla:64,rope=64`
/// within noise (115 -> 116: its op is arithmetic). A function of the sequence's own length
/// only, so a sequence's step sums alike alone and in a batch, whatever the threads.
fn block_len(len: usize) -> usize {
    len.div_ceil(4)
        .next_multiple_of(BLOCK)
        .clamp(BLOCK, MAX_BLOCK)
}

/// `softmax(q · kᵀ · scale) · v` for q (B, H, 1, Dk), k (B, G, S, Dk), v (B, G, S, Dv),
/// H a multiple of G; k and v may be views of a longer cache (k's rows contiguous, v's rows
/// each contiguous but possibly further apart: MLA's values are the first kv_lora_rank
/// columns of its cached rows `[c_kv | k_pe]`, whose whole rows are its keys). With `pages`,
/// k and v are a pool's whole tensors and the positions are `pages`' (S is the pool's size).
#[derive(Debug, Clone, Copy)]
pub struct DecodeAttention<'a> {
    pub scale: f32,
    pub pages: Option<&'a Pages>,
}

/// Whether the op takes this query: f32 or bf16 on a CPU with AVX-512, AVX2 + FMA or NEON,
/// the sets `accumulate` has a vector form for. Elsewhere candle's ops stay.
pub fn takes(q: &candle_core::Tensor) -> bool {
    q.device().is_cpu()
        && matches!(q.dtype(), DType::F32 | DType::BF16)
        && matches!(
            Isa::current().kind(),
            IsaKind::Avx512 | IsaKind::Avx2 | IsaKind::Neon
        )
}

/// One (batch, K/V head, block)'s result, per query head of the group, in `hg · (2 + Dv)`
/// values: the max scores (hg), the sums of `exp(score - max)` (hg), and the unnormalised
/// sums `Σ exp(score - max) · v` (hg rows of Dv).
fn partial_len(hg: usize, dv: usize) -> usize {
    hg * (2 + dv)
}

/// Where a (batch, head) starts in a storage, and the step from one row to the next,
/// checking that each row is contiguous and, unless `gaps`, that the rows are packed.
fn head_offset(l: &Layout, b: usize, g: usize, what: &str, gaps: bool) -> Result<(usize, usize)> {
    let (st, d) = (l.stride(), l.dims());
    // A dimension of size 1 has no step to check (candle calls such a layout contiguous
    // whatever its stride: a one-position cache rebuilt by the low-rank attention).
    let row = if d[2] > 1 { st[2] } else { d[3] };
    if (st[3] != 1 && d[3] > 1) || row < d[3] || (!gaps && row != d[3]) {
        return Err(Error::Msg(format!(
            "decode attention: {what} rows are not contiguous"
        )));
    }
    Ok((l.start_offset() + b * st[0] + g * st[1], row))
}

/// The cache's element types: f32 as is, bf16 as raw bits (keys for the pair-reading
/// kernels, values read in pairs or widened in [`accumulate`]). The query comes in the form
/// the key kernel reads ([`Query`]), made once per step by the caller.
pub(super) trait Cached: Copy + Sync {
    /// `out[h·ld + j]` = query head h · key row j, for every row of `k`.
    ///
    /// # Safety
    /// `out` is valid for writes at every `h·ld + j` and nothing else touches them.
    unsafe fn scores(isa: Isa, q: Query, d: usize, k: &[Self], out: *mut f32, ld: usize);
    fn widen(self) -> f32;
    /// The values as raw bf16 bits, for the pair-reading value sum (`pairs`): `None` for f32.
    #[cfg(target_arch = "x86_64")]
    fn bf16_bits(v: &[Self]) -> Option<&[u16]>;
    /// [`accumulate`] on NEON for this element type (`arm`).
    #[cfg(target_arch = "aarch64")]
    fn accumulate_neon(p: &[f32], v: &[Self], dv: (usize, usize), acc: &mut [f32]);
}

impl Cached for f32 {
    unsafe fn scores(isa: Isa, q: Query, d: usize, k: &[f32], out: *mut f32, ld: usize) {
        let Query::F32(q) = q else {
            unreachable!("an f32 cache's query is f32 (`attend_op`, `attend_each`)");
        };
        // SAFETY: the caller's contract is the kernel's.
        unsafe { simd::rows_f32_strided(isa, q, d, k, out, ld) }
    }
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    fn bf16_bits(_: &[f32]) -> Option<&[u16]> {
        None
    }
    #[cfg(target_arch = "aarch64")]
    fn accumulate_neon(p: &[f32], v: &[f32], dv: (usize, usize), acc: &mut [f32]) {
        // SAFETY: NEON is in every aarch64 CPU (and `Isa` has asked this one).
        unsafe { arm::accumulate(p, v, dv, acc) }
    }
}

impl Cached for u16 {
    unsafe fn scores(isa: Isa, q: Query, d: usize, k: &[u16], out: *mut f32, ld: usize) {
        // SAFETY: as for f32 (bf16 queries only where `isa` multiplies bf16 pairs).
        unsafe {
            match q {
                Query::Paired(q) => simd::rows_bf16_strided(isa, q, d, k, out, ld),
                // Several heads over keys of whole registers: transposed, no lane sums.
                #[cfg(target_arch = "x86_64")]
                Query::Bf16(q) if q.len() > d && keys::takes(d) => keys::scores(q, d, k, out, ld),
                Query::Bf16(q) => simd::rows_bf16_pairs_strided(isa, q, d, k, out, ld),
                Query::F32(_) => unreachable!("a bf16 cache's query is made by `Queries`"),
            }
        }
    }
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits((self as u32) << 16)
    }
    #[cfg(target_arch = "x86_64")]
    fn bf16_bits(v: &[u16]) -> Option<&[u16]> {
        Some(v)
    }
    #[cfg(target_arch = "aarch64")]
    fn accumulate_neon(p: &[f32], v: &[u16], dv: (usize, usize), acc: &mut [f32]) {
        // SAFETY: as for f32.
        unsafe { arm::accumulate(p, v, dv, acc) }
    }
}

thread_local! {
    /// A thread's scores (and a paged block's weights run by run, and a head's max and sum)
    /// kept between calls of [`block`]: with a result of three vectors an item, and its
    /// scores a fourth, a batched step's many short blocks spent much of the op in malloc
    /// and free across the threads. 8 sequences of 80 positions in one op, in the caches
    /// (`probe_decode_attention`, Zen 5): 22.5 -> 9.8 us a layer; a batched step (weights
    /// and caches from memory) within noise.
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Attention over some positions of one (batch, K/V head): `q` holds the group's query heads
/// (hg × dk), `k` and `v` that head's cached rows from pool position 0 (v's `vs` apart),
/// `runs` the positions as (first pool row, rows) in order; the result `to` a head's values
/// or a partial.
fn block<T: Cached>(
    isa: Isa,
    scale: f32,
    q: Query,
    (k, v): (&[T], &[T]),
    (dk, dv, vs): (usize, usize, usize),
    runs: &[(usize, usize)],
    to: To,
) {
    let hg = q.len() / dk;
    let len: usize = runs.iter().map(|&(_, n)| n).sum();
    for &(at, n) in runs {
        prefetch_values(&v[at * vs..(at + n - 1) * vs + dv]);
    }
    SCRATCH.with_borrow_mut(|scratch| {
        let need = 2 * hg * len + 2 * hg;
        if scratch.len() < need {
            scratch.resize(need, 0.0);
        }
        // Every value is written below before it is read: no zeroing.
        let (s, rest) = scratch[..need].split_at_mut(hg * len);
        let (p, own) = rest.split_at_mut(hg * len);
        let (whole, (stats, acc)) = match to {
            To::Whole(acc) => (true, (own, acc)),
            To::Partial(part) => (false, part.split_at_mut(2 * hg)),
        };
        let (max, sum) = stats.split_at_mut(hg);
        let mut col = 0;
        for &(at, n) in runs {
            assert!(
                col + n <= len && (at + n) * dk <= k.len(),
                "runs inside the keys"
            );
            // SAFETY: s holds hg rows of len; this run writes columns col..col + n of each.
            unsafe {
                T::scores(
                    isa,
                    q,
                    dk,
                    &k[at * dk..(at + n) * dk],
                    s.as_mut_ptr().add(col),
                    len,
                )
            };
            col += n;
        }
        for ((row, m), total) in s
            .chunks_exact_mut(len)
            .zip(max.iter_mut())
            .zip(sum.iter_mut())
        {
            (*m, *total) = tile::softmax_row(isa, row, scale);
        }
        let values = |at: usize, n: usize| &v[at * vs..(at + n - 1) * vs + dv];
        match runs {
            [(at, n)] => tile::accumulate(isa, s, values(*at, *n), (dv, vs), acc),
            _ => {
                // Each run's weights as hg rows of its own, then its values.
                let mut col = 0;
                for &(at, n) in runs {
                    let p = &mut p[..hg * n];
                    for (row, w) in s.chunks_exact(len).zip(p.chunks_exact_mut(n)) {
                        w.copy_from_slice(&row[col..col + n]);
                    }
                    tile::accumulate(isa, p, values(at, n), (dv, vs), acc);
                    col += n;
                }
            }
        }
        if whole {
            for (row, total) in acc.chunks_exact_mut(dv).zip(&*sum) {
                row.iter_mut().for_each(|o| *o /= total);
            }
        }
    });
}

/// Where [`block`] puts its result: a head's only block, normalised, into the head's hg rows
/// of dv values; one of several, into its [partial](partial_len) for the merge.
enum To<'a> {
    Whole(&'a mut [f32]),
    Partial(&'a mut [f32]),
}

/// The bytes of a block's values [`prefetch_values`] asks for: the start of the stream,
/// after which the hardware prefetcher follows it. All of a long block's values (up to 256
/// KiB) at once evicted its keys: a 4000-token bf16 decode 110 -> 105 tok/s.
#[cfg(target_arch = "x86_64")]
const PREFETCH_VALUES: usize = 16 * 1024;

/// Asks for the first lines of `v` now, so that they arrive while the scores are computed: a
/// batched step's caches are evicted from L3 by the weights between one layer's turn and the
/// next, and a short block's values were read from memory after its scores. SmolLM2-135M Q4_0
/// `bench --batch 8` (Zen 5, 6 alternating rounds, medians): 1508 -> 1553 tok/s; a 4000-token
/// bf16 decode even (110 / 111).
fn prefetch_values<T>(v: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        let bytes = std::mem::size_of_val(v).min(PREFETCH_VALUES);
        let p = v.as_ptr() as *const i8;
        for at in (0..bytes).step_by(64) {
            // SAFETY: a prefetch is a hint: it never faults, and `at` is inside `v`.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.add(at))
            };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = v;
}

/// One (sequence, K/V head) of a step: its group's query heads (hg × dk), that head's
/// cached keys and values from the row its positions count from (value rows `vs` apart),
/// and where its `len` positions are: through `pages`, or the first `len` rows.
struct Head<'a, T> {
    q: Query<'a>,
    k: &'a [T],
    v: &'a [T],
    vs: usize,
    pages: Option<&'a Pages>,
    len: usize,
}

/// Runs every (head, block) on the pool and merges the blocks of each head: each head's
/// query heads' `dv` values, head after head. A head of one block (a short context: every
/// head of a batched step early in its answers) is normalised by its item, in place; the
/// others' blocks leave [partials](partial_len), merged here.
fn attend<T: Cached>(scale: f32, heads: &[Head<'_, T>], (dk, dv): (usize, usize)) -> Vec<f32> {
    let isa = Isa::current();
    // Head i's blocks are work items starts[i]..starts[i + 1], its values are out[outs[i]..]
    // and, of more than one block, its blocks' partials are parts[at[i]..].
    let (mut starts, mut outs, mut at) = (vec![0], vec![0], vec![0]);
    for h in heads {
        let (blocks, hg) = (h.len.div_ceil(block_len(h.len)), h.q.len() / dk);
        starts.push(starts[starts.len() - 1] + blocks);
        outs.push(outs[outs.len() - 1] + hg * dv);
        let kept = if blocks > 1 {
            blocks * partial_len(hg, dv)
        } else {
            0
        };
        at.push(at[at.len() - 1] + kept);
    }
    let items = starts[heads.len()];
    let mut out = vec![0f32; outs[heads.len()]];
    let mut parts = vec![0f32; at[heads.len()]];
    let (whole, partial) = (Disjoint(out.as_mut_ptr()), Disjoint(parts.as_mut_ptr()));
    Pool::global().run(items, &|i| {
        let head = starts.partition_point(|&s| s <= i) - 1;
        let h = &heads[head];
        let (c, hg) = (i - starts[head], h.q.len() / dk);
        let b = block_len(h.len);
        let (p0, p1) = (c * b, ((c + 1) * b).min(h.len));
        let (one, paged);
        let runs: &[(usize, usize)] = match h.pages {
            Some(pages) => {
                paged = pages.runs(p0, p1);
                &paged
            }
            None => {
                one = [(p0, p1 - p0)];
                &one
            }
        };
        let to = match starts[head + 1] - starts[head] {
            // SAFETY: this head's one item alone writes its hg · dv values of `out`.
            1 => To::Whole(unsafe { from_raw_parts_mut(whole.at(outs[head]), hg * dv) }),
            _ => {
                let n = partial_len(hg, dv);
                // SAFETY: item c of this head alone writes its partial, n values of `parts`.
                To::Partial(unsafe { from_raw_parts_mut(partial.at(at[head] + c * n), n) })
            }
        };
        block(isa, scale, h.q, (h.k, h.v), (dk, dv, h.vs), runs, to);
    });
    // Merge: out = Σ_c e^(max_c - M) acc_c / Σ_c e^(max_c - M) sum_c, M the overall max.
    for (head, h) in heads.iter().enumerate() {
        let (blocks, hg) = (starts[head + 1] - starts[head], h.q.len() / dk);
        if blocks == 1 {
            continue;
        }
        let n = partial_len(hg, dv);
        let parts = &parts[at[head]..at[head] + blocks * n];
        for j in 0..hg {
            let (max, sum) = (|p: &[f32]| p[j], |p: &[f32]| p[hg + j]);
            let top = parts
                .chunks_exact(n)
                .fold(f32::NEG_INFINITY, |a, p| a.max(max(p)));
            let o = &mut out[outs[head] + j * dv..outs[head] + (j + 1) * dv];
            let mut total = 0f32;
            for p in parts.chunks_exact(n) {
                let w = (max(p) - top).exp();
                total += w * sum(p);
                let acc = &p[2 * hg + j * dv..2 * hg + (j + 1) * dv];
                for (o, a) in o.iter_mut().zip(acc) {
                    *o += w * a;
                }
            }
            o.iter_mut().for_each(|o| *o /= total);
        }
    }
    out
}

/// [`attend`] over the op's (batch, K/V head)s: q (B, H, 1, Dk), k and v (B, G, S, ..) as
/// laid out, every one at the op's positions.
fn attend_op<T: Cached>(
    op: &DecodeAttention,
    q: Query,
    (k, kl): (&[T], &Layout),
    (v, vl): (&[T], &Layout),
    (b, h, dk): (usize, usize, usize),
) -> Result<Vec<f32>> {
    let (rows, dv) = (kl.dims()[2], vl.dims()[3]);
    let mut heads = Vec::new();
    for bi in 0..b {
        let at = (op.pages, op.pages.map_or(rows, Pages::len));
        push_heads(&mut heads, (q, bi, h, dk), (k, kl), (v, vl), bi, at)?;
    }
    Ok(attend(op.scale, &heads, (dk, dv)))
}

/// The K/V heads of batch `b` of k's and v's layouts (their rows from pool position 0), for
/// sequence `s`'s `h` query heads of `dk` values in `q`, at `len` positions read through
/// `pages` (or the first `len` rows).
fn push_heads<'a, T: Cached>(
    heads: &mut Vec<Head<'a, T>>,
    (q, s, h, dk): (Query<'a>, usize, usize, usize),
    (k, kl): (&'a [T], &Layout),
    (v, vl): (&'a [T], &Layout),
    b: usize,
    (pages, len): (Option<&'a Pages>, usize),
) -> Result<()> {
    let (_, g, rows, _) = kl.shape().dims4()?;
    let (dv, hg) = (vl.dims()[3], h / g);
    for gi in 0..g {
        let (ko, _) = head_offset(kl, b, gi, "k", false)?;
        let (vo, vs) = head_offset(vl, b, gi, "v", true)?;
        let q0 = (s * h + gi * hg) * dk;
        heads.push(Head {
            q: q.slice(q0..q0 + hg * dk),
            k: &k[ko..ko + rows * dk],
            v: &v[vo..vo + (rows - 1) * vs + dv],
            vs,
            pages,
            len,
        });
    }
    Ok(())
}

impl CustomOp3 for DecodeAttention<'_> {
    fn name(&self) -> &'static str {
        "decode-attention"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (b, h, t, dk) = ql.shape().dims4()?;
        let (kb, g, s, kd) = kl.shape().dims4()?;
        let (vb, vg, vs_len, dv) = vl.shape().dims4()?;
        if t != 1 || kb != b || vb != b || kd != dk || vg != g || vs_len != s || g == 0 {
            return Err(Error::Msg(format!(
                "decode attention: q {:?}, k {:?}, v {:?} do not fit",
                ql.dims(),
                kl.dims(),
                vl.dims()
            )));
        }
        // A block table is one sequence's.
        let paged_fits = self.pages.is_none_or(|p| b == 1 && p.within(s));
        if s == 0 || h % g != 0 || !paged_fits {
            return Err(Error::Msg(
                "decode attention: no keys, heads not grouped, or pages outside the pool".into(),
            ));
        }
        let Some((q0, q1)) = ql.contiguous_offsets() else {
            return Err(Error::Msg("decode attention: q must be contiguous".into()));
        };
        let shape = Shape::from((b, h, 1, dv));
        Ok(match (qs, ks, vs) {
            (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v)) => {
                let out = attend_op(self, Query::F32(&q[q0..q1]), (k, kl), (v, vl), (b, h, dk))?;
                (CpuStorage::F32(out), shape)
            }
            // f32 activations over a bf16 cache (`crate::model::activation_dtype`).
            (CpuStorage::F32(q), CpuStorage::BF16(k), CpuStorage::BF16(v)) => {
                let q = Queries::bf16(Isa::current(), &q[q0..q1], dk);
                let out = attend_op(self, q.view(), (bits(k), kl), (bits(v), vl), (b, h, dk))?;
                (CpuStorage::F32(out), shape)
            }
            (CpuStorage::BF16(q), CpuStorage::BF16(k), CpuStorage::BF16(v)) => {
                let q: Vec<f32> = q[q0..q1].iter().map(|v| v.to_f32()).collect();
                let q = Queries::bf16(Isa::current(), &q, dk);
                let out = attend_op(self, q.view(), (bits(k), kl), (bits(v), vl), (b, h, dk))?;
                (
                    CpuStorage::BF16(out.into_iter().map(bf16::from_f32).collect()),
                    shape,
                )
            }
            (q, _, _) => {
                return Err(Error::Msg(format!(
                    "decode attention: unsupported dtype {:?}",
                    q.dtype()
                )))
            }
        })
    }
}

#[cfg(target_arch = "aarch64")]
mod arm;
mod each;
#[cfg(target_arch = "x86_64")]
pub(super) mod keys;
#[cfg(target_arch = "x86_64")]
pub(super) mod pairs;
mod query;
mod tile;

pub use each::attend_each;
pub(super) use tile::accumulate;
pub(crate) use tile::exp;
pub(crate) use tile::softmax_row;

/// bf16 values as their raw bits.
pub(super) fn bits(x: &[bf16]) -> &[u16] {
    // SAFETY: half::bf16 is #[repr(transparent)] over u16: same size, alignment and length.
    unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u16, x.len()) }
}
