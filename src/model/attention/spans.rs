//! A batched step's spans through attention: the single new tokens that the fused decode op
//! takes run together in one parallel loop ([`super::decode::attend_each`]), every other
//! span (a prompt chunk, a token on another device) on its own ([`sdpa_held`]).

use super::{decode, decode_takes, join, sdpa_held, Span};
use crate::kv_cache::Held;
use candle_core::{DType, Result, Tensor};

/// Every span's attention over what its cache holds (`helds[i]`, after the step's write),
/// joined as (1, N, H·Dv) in the spans' order: q is (1, H, N, Dk). Two or more single new
/// tokens that the decode op takes run together in one parallel loop
/// ([`decode::attend_each`]); every other span is [`sdpa_held`] on its own.
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
    let together: Vec<usize> = (0..spans.len())
        .filter(|&i| {
            let (span, held) = (&spans[i], &helds[i]);
            span.len == 1 && span.mask.is_none() && decode_takes(q, &held.k, &held.v)
        })
        .collect();
    if together.len() < 2 {
        return join((0..spans.len()).map(one).collect::<Result<Vec<_>>>()?);
    }
    // The queries as rows of H·Dk, in f32: (1, N, H, Dk).
    let rows = q.to_dtype(DType::F32)?.transpose(1, 2)?.contiguous()?;
    let rows = rows.flatten_all()?.to_vec1::<f32>()?;
    let qs: Vec<f32> = (together.iter())
        .flat_map(|&i| rows[spans[i].start * h * dk..][..h * dk].iter().copied())
        .collect();
    let which: Vec<&Held> = together.iter().map(|&i| &helds[i]).collect();
    let out = decode::attend_each(scale as f32, &qs, h, &which)?;
    let width = out.len() / together.len();
    let out = Tensor::from_vec(out, (1, together.len(), width), q.device())?.to_dtype(q.dtype())?;
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
