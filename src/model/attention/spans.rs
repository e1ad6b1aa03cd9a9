//! A batched step's spans through attention: the single new tokens that the fused decode op
//! takes run together in one parallel loop ([`super::decode::attend_each`]), or elsewhere
//! off the CPU (a GPU), when their caches share a pool, in one batched product
//! ([`pooled_tokens`]); every other span (a prompt chunk, a token masked by a sliding
//! window, one alone in its pool) on its own ([`sdpa_held`]).

use super::{attend, decode, decode_takes, join, sdpa_held, Span};
use crate::kv_cache::{Held, Pages};
use candle_core::{DType, Error, Result, Tensor};

/// Every span's attention over what its cache holds (`helds[i]`, after the step's write),
/// joined as (1, N, H·Dv) in the spans' order: q is (1, H, N, Dk). Two or more single new
/// tokens that the decode op takes run together in one parallel loop
/// ([`decode::attend_each`]), or off the CPU, two or more whose caches share a pool in
/// [`pooled_tokens`]; every other span is [`sdpa_held`] on its own.
pub fn sdpa_spans(q: &Tensor, helds: &[Held], spans: &[Span], scale: f64) -> Result<Tensor> {
    let (b, h, _, dk) = q.dims4()?;
    let one = |i: usize| {
        let y = sdpa_held(
            &spans[i].rows(q, 2)?,
            &helds[i],
            scale,
            spans[i].mask.as_ref(),
        )?;
        let dv = y.dim(3)?;
        y.transpose(1, 2)?.reshape((b, spans[i].len, h * dv)) // (1, len, H·Dv)
    };
    let single = |i: &usize| spans[*i].len == 1 && spans[*i].mask.is_none();
    let fused: Vec<usize> = (0..spans.len())
        .filter(single)
        .filter(|&i| decode_takes(q, &helds[i].k, &helds[i].v))
        .collect();
    let (together, out) = if fused.len() >= 2 {
        // The queries as rows of H·Dk, in f32: (1, N, H, Dk).
        let rows = q.to_dtype(DType::F32)?.transpose(1, 2)?.contiguous()?;
        let rows = rows.flatten_all()?.to_vec1::<f32>()?;
        let mut qs = Vec::with_capacity(fused.len() * h * dk);
        for &i in &fused {
            qs.extend_from_slice(&rows[spans[i].start * h * dk..][..h * dk]);
        }
        let which: Vec<&Held> = fused.iter().map(|&i| &helds[i]).collect();
        let out = decode::attend_each(scale as f32, &qs, h, &which)?;
        let width = out.len() / fused.len();
        let out = Tensor::from_vec(out, (1, fused.len(), width), q.device())?;
        (fused, out.to_dtype(q.dtype())?)
    } else {
        // Off the CPU (there, what the decode op does not take goes one by one, widened to
        // f32 when the cache is not: `sdpa`).
        let first = (0..spans.len())
            .find(single)
            .filter(|_| !q.device().is_cpu());
        let pooled: Vec<usize> = match first {
            Some(first) => (0..spans.len())
                .filter(single)
                .filter(|&i| helds[i].pooled_with(&helds[first]))
                .collect(),
            None => Vec::new(),
        };
        if pooled.len() < 2 {
            return join((0..spans.len()).map(one).collect::<Result<Vec<_>>>()?);
        }
        let out = pooled_tokens(q, helds, spans, &pooled, scale)?;
        (pooled, out)
    };
    if together.len() == spans.len() {
        return Ok(out);
    }
    let mut parts = Vec::with_capacity(spans.len());
    let mut next = together.iter().enumerate().peekable();
    for i in 0..spans.len() {
        match next.next_if(|&(_, &t)| t == i) {
            Some((j, _)) => parts.push(out.narrow(1, j, 1)?),
            None => parts.push(one(i)?),
        }
    }
    join(parts)
}

/// Single new tokens `which` whose caches are one pool's, in candle's ops (a device without
/// the fused decode op, such as a GPU): every sequence's positions gathered from the pool in
/// one `index_select` per tensor, padded to the longest with its first position and masked
/// there, and [`attend`] over them all at once, the sequences in place of its groups.
/// Returns (1, N, H·Dv). One sequence at a time, each is about ten small ops a layer, and a
/// GPU runs them far below its speed.
pub(super) fn pooled_tokens(
    q: &Tensor,
    helds: &[Held],
    spans: &[Span],
    which: &[usize],
    scale: f64,
) -> Result<Tensor> {
    let (_, h, _, dk) = q.dims4()?;
    let (k, v) = (&helds[which[0]].k, &helds[which[0]].v);
    let (g, dev, n) = (k.dim(1)?, q.device(), which.len());
    let pages = (which.iter())
        .map(|&i| {
            (helds[i].pages).ok_or_else(|| Error::Msg("pooled: a cache without a table".into()))
        })
        .collect::<Result<Vec<&Pages>>>()?;
    let long = pages.iter().map(|p| p.len()).max().unwrap_or(0);
    let (mut at, mut mask) = (Vec::with_capacity(n * long), Vec::with_capacity(n * long));
    for p in &pages {
        for j in 0..long {
            let seen = j < p.len();
            at.push(p.at(if seen { j } else { 0 }) as u32);
            mask.push(if seen { 0f32 } else { f32::NEG_INFINITY });
        }
    }
    let at = Tensor::from_vec(at, n * long, dev)?;
    // Broadcast over (G, N, H/G, 1, L) in `attend`: sequence n's padding hidden.
    let mask = Tensor::from_vec(mask, (1, n, 1, 1, long), dev)?;
    // (1, G, N·L, D) -> (G, N, L, D).
    let gather = |t: &Tensor| t.index_select(&at, 2)?.reshape((g, n, long, t.dim(3)?));
    let (k, v) = (gather(k)?, gather(v)?);
    let starts: Vec<u32> = which.iter().map(|&i| spans[i].start as u32).collect();
    let q = q.index_select(&Tensor::new(starts.as_slice(), dev)?, 2)?; // (1, H, N, Dk)
    let q = (q.reshape((g, h / g, n, dk))?.transpose(1, 2)?).contiguous()?; // (G, N, H/G, Dk)
    let scores = q.matmul(&k.t()?)?; // (G, N, H/G, L)
    let y = attend(&scores, &v, n * h / g, 1, scale, Some(&mask))?; // (G, N·H/G, 1, Dv)
    let dv = y.dim(3)?;
    // (G, N, H/G, Dv) -> (N, G, H/G, Dv): each token's heads in `sdpa`'s order, g·H/G + r.
    y.reshape((g, n, h / g, dv))?
        .transpose(0, 1)?
        .reshape((1, n, h * dv))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use crate::kv_cache::{KvCache, KvPool};
    use candle_core::Device;

    /// Sequences of 40, 45 and 70 positions in one pool, grown a token at a time by turns so
    /// that their blocks interleave: their next tokens through [`pooled_tokens`] (the GPU's
    /// path, run here on the CPU) attend as each alone ([`sdpa_held`] over its own
    /// positions), with a prompt span between them in the step.
    #[test]
    fn pooled_tokens_attend_as_each_sequence_alone() -> Result<()> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let cfg = ModelConfig::from_file(&dir.join("configs/tiny-gqa.json")).unwrap();
        let (dev, (h, g, d)) = (Device::Cpu, (4, 2, 32));
        let per_token = cfg.kv_bytes_per_token(4);
        let pool = KvPool::new(&cfg, 4 * 96 * per_token, DType::F32, &dev).unwrap();
        let mut caches: Vec<KvCache> = (0..4).map(|_| pool.sequence(96)).collect();
        let lens = [40, 45, 70, 0];
        let kv = |t: usize| Tensor::randn(0f32, 1.0, (1, g, t, d), &dev);
        fn write<'a>(c: &'a KvCache, pages: &'a Pages, k: &Tensor, v: &Tensor) -> Result<Held<'a>> {
            c.layer(0, pages).write_held(k, v, c.len())
        }
        for p in 0..70 {
            for (cache, &len) in caches.iter_mut().zip(&lens) {
                if p < len {
                    cache.reserve(1).unwrap();
                    let pages = cache.pages(p + 1);
                    write(cache, &pages, &kv(1)?, &kv(1)?)?;
                    cache.advance(&[0]);
                }
            }
        }
        // The step: one token each for the three, a prompt of 5 for the fourth (second).
        let order = [0, 3, 1, 2];
        let sizes = [1, 5, 1, 1];
        let mut spans = Vec::new();
        let mut start = 0;
        for (&s, &n) in order.iter().zip(&sizes) {
            caches[s].reserve(n).unwrap();
            spans.push(Span::new(start, n, lens[s], 1 << 20, &dev)?);
            start += n;
        }
        let pages: Vec<Pages> = (order.iter().zip(&sizes))
            .map(|(&s, &n)| caches[s].pages(lens[s] + n))
            .collect();
        let helds = (order.iter().zip(&sizes).zip(&pages))
            .map(|((&s, &n), pages)| write(&caches[s], pages, &kv(n)?, &kv(n)?))
            .collect::<Result<Vec<_>>>()?;
        // (On the CPU a table of one run is read as views, so the fourth's is not pooled.)
        assert!([2, 3].iter().all(|&i| helds[i].pooled_with(&helds[0])));
        let q = Tensor::randn(0f32, 1.0, (1, h, start, d), &dev)?;
        let scale = 0.125;
        let got = pooled_tokens(&q, &helds, &spans, &[0, 2, 3], scale)?;
        for (j, &i) in [0, 2, 3].iter().enumerate() {
            let want = sdpa_held(&spans[i].rows(&q, 2)?, &helds[i], scale, None)?;
            let want = want.transpose(1, 2)?.reshape((1, 1, h * d))?;
            let diff = (got.narrow(1, j, 1)? - want)?.abs()?.max_all()?;
            assert!(diff.to_scalar::<f32>()? < 1e-5, "sequence {}", order[i]);
        }
        // And the whole step's join puts each span's rows in place.
        let all = sdpa_spans(&q, &helds, &spans, scale)?;
        assert_eq!(all.dims(), &[1, start, h * d]);
        Ok(())
    }
}
