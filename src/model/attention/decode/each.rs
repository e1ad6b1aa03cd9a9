//! The decode op for many sequences at once, each over its own cache: a batched step's
//! single new tokens (the server's decoding requests, `bench --batch`) in one parallel loop
//! over every (sequence, K/V head, block).
//!
//! One op per sequence ran a loop per sequence: with SmolLM2's 3 K/V heads and contexts
//! under 256 positions that is 3 work items for 2 threads, one of them idle a third of the
//! time, eight times a layer, and the op's setup (a query copy, storage locks, the merge)
//! per sequence. The caches are tensors of their own (one pool's shared tensors, or one
//! per sequence), more than a candle op takes, so this reads their storages directly.

use super::query::{Queries, Query};
use super::{attend, bits, push_heads, Cached};
use crate::kv_cache::{Held, Pages};
use crate::model::linear::simd;
use candle_core::{CpuStorage, Error, Layout, Result, Storage};

/// `softmax(q · kᵀ · scale) · v` for each sequence's one new token over what its cache holds
/// (`helds[i]`, after this step's write; f32 or bf16, the same for all): `q` holds each
/// sequence's `h` query heads of Dk values in f32, in order; returns each one's `h · Dv`
/// values, in order. The same per head as [`super::DecodeAttention`].
pub fn attend_each(scale: f32, q: &[f32], h: usize, helds: &[&Held]) -> Result<Vec<f32>> {
    // Read locks only: nothing writes a cache while a step reads it (a step is one thread's
    // until it returns), so locking one pool's storage once per sequence cannot wait.
    let ks: Vec<_> = helds
        .iter()
        .map(|held| held.k.storage_and_layout())
        .collect();
    let vs: Vec<_> = helds
        .iter()
        .map(|held| held.v.storage_and_layout())
        .collect();
    let dk = match ks.first() {
        Some((_, l)) => l.shape().dims4()?.3,
        None => return Ok(Vec::new()),
    };
    if h == 0 || q.len() != helds.len() * h * dk {
        return Err(Error::Msg(format!(
            "decode attention: {} query values for {} sequences of {h} heads of {dk}",
            q.len(),
            helds.len()
        )));
    }
    let pages: Vec<Option<&Pages>> = helds.iter().map(|held| held.pages).collect();
    let pairs = ks
        .iter()
        .zip(&vs)
        .map(|((k, kl), (v, vl))| (&**k, *kl, &**v, *vl));
    if ks
        .iter()
        .all(|(k, _)| matches!(&**k, Storage::Cpu(CpuStorage::F32(_))))
    {
        let caches = pairs
            .map(|(k, kl, v, vl)| Ok(((f32s(k)?, kl), (f32s(v)?, vl))))
            .collect::<Result<Vec<_>>>()?;
        return run(scale, Query::F32(q), (h, dk), &caches, &pages);
    }
    let caches = pairs
        .map(|(k, kl, v, vl)| Ok(((bf16s(k)?, kl), (bf16s(v)?, vl))))
        .collect::<Result<Vec<_>>>()?;
    let q = Queries::bf16(simd::Isa::current(), q, dk);
    run(scale, q.view(), (h, dk), &caches, &pages)
}

type Cache<'a, T> = ((&'a [T], &'a Layout), (&'a [T], &'a Layout));

/// [`attend`] over every sequence's K/V heads.
fn run<T: Cached>(
    scale: f32,
    q: Query,
    (h, dk): (usize, usize),
    caches: &[Cache<'_, T>],
    pages: &[Option<&Pages>],
) -> Result<Vec<f32>> {
    let mut heads = Vec::new();
    let dv = match caches.first() {
        Some((_, (_, vl))) => vl.shape().dims4()?.3,
        None => return Ok(Vec::new()),
    };
    for (bi, (((k, kl), (v, vl)), pages)) in caches.iter().zip(pages).enumerate() {
        let (b, g, rows, kd) = kl.shape().dims4()?;
        let (vb, vg, vrows, vd) = vl.shape().dims4()?;
        let fits = pages.is_none_or(|p| p.within(rows));
        let len = pages.map_or(rows, Pages::len);
        if b != 1
            || vb != 1
            || g == 0
            || h % g != 0
            || vg != g
            || vrows != rows
            || kd != dk
            || vd != dv
            || len == 0
            || !fits
        {
            return Err(Error::Msg(format!(
                "decode attention: sequence {bi}'s cache k {:?}, v {:?} does not fit {h} query \
                 heads of {dk}",
                kl.dims(),
                vl.dims()
            )));
        }
        push_heads(
            &mut heads,
            (q, bi, h, dk),
            (k, kl),
            (v, vl),
            0,
            (*pages, len),
        )?;
    }
    Ok(attend(scale, &heads, (dk, dv)))
}

fn f32s(s: &Storage) -> Result<&[f32]> {
    match s {
        Storage::Cpu(CpuStorage::F32(v)) => Ok(v),
        _ => Err(Error::Msg("decode attention: caches of mixed types".into())),
    }
}

fn bf16s(s: &Storage) -> Result<&[u16]> {
    match s {
        Storage::Cpu(CpuStorage::BF16(v)) => Ok(bits(v)),
        _ => Err(Error::Msg(
            "decode attention: a cache neither f32 nor bf16, or caches of mixed types".into(),
        )),
    }
}
