//! The two forms of MLA attention over the latent cache, and the fold that lets the
//! absorbed one run without per-head products ([`UpProj::Folded`]): `up_project` builds
//! per-head K and V (the expanded form, for prompts), `absorbed` attends over the cached
//! rows as one K/V head.

use super::{MlaAttention, UpProj};
use crate::config::MlaConfig;
use crate::kv_cache::Held;
use crate::model::activation_dtype;
use crate::model::attention::{decode, sdpa, sdpa_held};
use crate::model::cpu::{cat_rows, f32_rows};
use crate::model::linear::simd::{self, Isa};
use crate::model::linear::{matvec, Linear};
use crate::model::pool::{Disjoint, Pool};
use candle_core::{CpuStorage, DType, Error, Result, Storage, Tensor, D};

/// `q_proj` and `o_proj` with `kv_b_proj` folded in ([`UpProj::Folded`]), in q_proj's and
/// o_proj's dtype: per head, the query's nope rows become `W_UKᵀ · W_q,nope` (r rows) beside
/// its RoPE rows, and o_proj's columns of the head become `W_o,h · W_UV` (r columns).
pub(super) fn fold(
    m: &MlaConfig,
    h: usize,
    (q_proj, o_proj): (&Linear, &Linear),
    (w_uk, w_uv): (&Tensor, &Tensor),
) -> Result<(Linear, Linear)> {
    let (r, nope, rope, v) = (
        m.kv_lora_rank,
        m.qk_nope_head_dim,
        m.qk_rope_head_dim,
        m.v_head_dim,
    );
    let (Some(wq), Some(wo)) = (q_proj.weight(), o_proj.weight()) else {
        return Err(Error::Msg(
            "MLA: folding needs dense q_proj and o_proj".into(),
        ));
    };
    let f64 = |t: &Tensor| t.to_dtype(candle_core::DType::F64);
    let (uk, uv) = (f64(w_uk)?, f64(w_uv)?);
    let c = wq.dim(1)?;
    let wq = f64(wq)?.reshape((h, nope + rope, c))?;
    // (H, r, nope) x (H, nope, C) -> (H, r, C), then each head's RoPE rows: (H·(r + rope), C)
    let q_lat = uk
        .transpose(1, 2)?
        .contiguous()?
        .matmul(&wq.narrow(1, 0, nope)?.contiguous()?)?;
    let q = Tensor::cat(&[q_lat, wq.narrow(1, nope, rope)?], 1)?.reshape((h * (r + rope), c))?;
    // (H, C, v) x (H, v, r) -> (H, C, r) -> (C, H·r)
    let out = wo.dim(0)?;
    let wo = f64(wo)?
        .reshape((out, h, v))?
        .transpose(0, 1)?
        .contiguous()?;
    let o = wo
        .matmul(&uv)?
        .transpose(0, 1)?
        .contiguous()?
        .reshape((out, h * r))?;
    let dtype = |l: &Linear| {
        l.weight()
            .map(|w| w.dtype())
            .unwrap_or(candle_core::DType::F32)
    };
    let q = Linear::new(q.to_dtype(dtype(q_proj))?, None);
    let o = Linear::new(o.to_dtype(dtype(o_proj))?, o_proj.bias().cloned());
    Ok((q, o))
}

impl MlaAttention {
    /// Per-head K = [C·W_UKᵀ, k_pe] (B, H, S, nope + rope) and V = C·W_UVᵀ (B, H, S, v).
    pub(super) fn up_project(&self, c_kv: &Tensor, k_pe: &Tensor) -> Result<(Tensor, Tensor)> {
        let UpProj::PerHead { w_uk, w_uv } = &self.up else {
            return Err(Error::Msg(
                "MLA: kv_b_proj is folded into q_proj and o_proj; no per-head K/V to cache".into(),
            ));
        };
        let m = &self.cfg;
        let (b, _, s, r) = c_kv.dims4()?;
        let h = self.num_heads;
        let (nope, v) = (m.qk_nope_head_dim, m.v_head_dim);
        // All heads in one product each, the halves seen as (H·width, r) matrices:
        // (B, S, r) x (H·width, r)ᵀ -> (B, S, H·width) -> (B, H, S, width)
        // In the activations' dtype (f32 on CPU, the halves read as stored): a bf16 cache's
        // latents widened once here, rather than K and V rounded to bf16 and widened again
        // for the attention. Except where the CPU multiplies bf16 pairs: there a bf16 cache's
        // latents and bf16 halves make K and V in bf16, which the prompt's attention reads
        // as they are (`prompt/fused.rs`; in f32 it missed those kernels).
        let pairs = [c_kv, w_uk].iter().all(|t| t.dtype() == DType::BF16)
            && c_kv.device().is_cpu()
            && simd::bf16_pairs(Isa::current());
        let act = match pairs {
            true => DType::BF16,
            false => activation_dtype(w_uk.dtype(), w_uk.device()),
        };
        let c_kv = c_kv.squeeze(1)?.to_dtype(act)?;
        let up = |w: &Tensor, width: usize| -> Result<Tensor> {
            let y = matvec(&c_kv, &w.reshape((h * width, r))?)?;
            y.reshape((b, s, h, width))?.transpose(1, 2)
        };
        let k_nope = up(w_uk, nope)?;
        let v = cat_last(&[&up(w_uv, v)?])?; // one part: a contiguous copy, row by row
        let k_pe = k_pe
            .to_dtype(act)?
            .broadcast_as((b, h, s, m.qk_rope_head_dim))?;
        let k = cat_last(&[&k_nope, &k_pe])?;
        Ok((k, v))
    }

    /// Attend over the latents as one shared K/V head (like MQA): the keys are the cached rows
    /// `[c_kv | k_pe]` (1, 1, S, r + rope), the values their first r columns (a view), and
    /// each query head is `[q_nope · W_UK, q_pe]`. One new token without a mask runs in the
    /// fused decode op of [`sdpa_held`], which reads each cached row once for all heads (through
    /// the block table of a paged cache).
    pub(super) fn absorbed(
        &self,
        q_nope: &Tensor,
        q_pe: &Tensor,
        rows: &Held,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let m = &self.cfg;
        let (b, h, t, _) = q_nope.dims4()?;
        let r = m.kv_lora_rank;
        let act = q_nope.dtype();
        // q_lat_i = q_nope_i · W_UK_i per head: (H, B·T, nope) x (H, nope, r) -> (H, B·T, r);
        // against bf16 halves on a CPU that multiplies bf16 pairs, q_nope is rounded to bf16
        // first, as a bf16 linear rounds its x there (`per_head`).
        let q_lat = match &self.up {
            UpProj::Folded => q_nope.clone(),
            UpProj::PerHead { w_uk, .. } => {
                let q_nope = q_nope
                    .to_dtype(activation_dtype(w_uk.dtype(), w_uk.device()))?
                    .transpose(0, 1)?
                    .contiguous()?
                    .reshape((h, b * t, m.qk_nope_head_dim))?;
                let q_lat = per_head(&q_nope, w_uk, false)?.to_dtype(act)?;
                q_lat.reshape((h, b, t, r))?.transpose(0, 1)? // (B, H, T, r)
            }
        };
        // (B, H, T, r + rope)
        let q = cat_last(&[&q_lat, &q_pe.to_dtype(act)?])?;
        // One new token: the fused op reads the values as a view of the rows (through the
        // block table of a paged cache). Otherwise `sdpa` on contiguous values: on CPU in the
        // cache's dtype (it widens bf16 rows, and where the decode op reads them as bf16
        // pairs, rounds the query alike), elsewhere in the activations'.
        let o_lat = match t == 1 && mask.is_none() && decode::takes(&rows.k) {
            true => sdpa_held(&q, rows, m.softmax_scale, mask)?,
            false => {
                let (rows, _) = rows.gathered()?;
                let rows = match rows.device().is_cpu() {
                    true => rows,
                    false => rows.to_dtype(act)?,
                };
                let v = rows.narrow(D::Minus1, 0, r)?.contiguous()?;
                sdpa(&q, &rows, &v, m.softmax_scale, mask)?
            }
        }; // (B, H, T, r)
        let UpProj::PerHead { w_uv, .. } = &self.up else {
            return o_lat.to_dtype(act); // o_proj reads the latent outputs
        };
        // o_i = o_lat_i · W_UV_iᵀ per head: (H, B·T, r) x (H, r, v) -> (H, B·T, v)
        let o_lat = o_lat
            .to_dtype(activation_dtype(w_uv.dtype(), w_uv.device()))?
            .transpose(0, 1)?
            .contiguous()?
            .reshape((h, b * t, r))?;
        let o = per_head(&o_lat, w_uv, true)?;
        o.reshape((h, b, t, m.v_head_dim))?
            .transpose(0, 1)? // (B, H, T, v)
            .to_dtype(act)
    }
}

/// Rank-4 tensors concatenated along the last dimension into a contiguous one: by
/// [`cat_rows`] on CPU, else candle's cat made contiguous (its cat of views along the last
/// dimension returns a strided view that its CUDA matmul refuses: "matmul is only supported
/// for contiguous tensors").
pub(super) fn cat_last(parts: &[&Tensor]) -> Result<Tensor> {
    match cat_rows(parts) {
        Some(y) => y,
        None => Tensor::cat(parts, D::Minus1)?.contiguous(),
    }
}

/// `x (H, M, K)` times each head's `w`, (H, M, N): `w` (H, K, N) gives `x_h · w_h`, and with
/// `rows` a `w` of (H, N, K) gives `x_h · w_hᵀ`. On CPU (f32 x, f32 or bf16 w) on our
/// kernels, the heads over the [`Pool`]: the decode op's value sum ([`decode::accumulate`])
/// or the rows product ([`simd`]). candle's batched matmul ran its general gemm on these
/// small products (one row of x a head in a decode step), 11% of `mla:192,rope=64`'s step on
/// two cores; head after head on one thread in f32 they were still 2 ms of its 14 ms at 32
/// positions (Zen 4). Elsewhere candle's matmul.
fn per_head(x: &Tensor, w: &Tensor, rows: bool) -> Result<Tensor> {
    let cpu = x.device().is_cpu() && w.device().is_cpu();
    if !(cpu && x.dtype() == DType::F32 && matches!(w.dtype(), DType::F32 | DType::BF16)) {
        let w = w.to_dtype(x.dtype())?;
        return match rows {
            true => x.matmul(&w.transpose(1, 2)?),
            false => x.matmul(&w),
        };
    }
    let ((h, m, k), (wh, a, b)) = (x.dims3()?, w.dims3()?);
    let (inner, n) = match rows {
        true => (b, a),
        false => (a, b),
    };
    if wh != h || inner != k || k == 0 {
        return Err(Error::Msg(format!(
            "MLA per-head product: x {:?} and w {:?} do not fit",
            x.dims(),
            w.dims()
        )));
    }
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    let mut y = vec![0f32; h * m * n];
    {
        let (xs, xl) = x.storage_and_layout();
        let (ws, wl) = w.storage_and_layout();
        let (Storage::Cpu(xs), Storage::Cpu(ws)) = (&*xs, &*ws) else {
            return Err(Error::Msg("MLA per-head product: not on the CPU".into()));
        };
        let xv = f32_rows(xs, xl, "MLA's x")?;
        let Some((w0, w1)) = wl.contiguous_offsets() else {
            return Err(Error::Msg("MLA's w must be contiguous".into()));
        };
        let out = Disjoint(y.as_mut_ptr());
        let shape = (m, k, n, rows);
        match ws {
            CpuStorage::F32(wv) => heads(xv, &wv[w0..w1], shape, &out),
            CpuStorage::BF16(wv) => heads(xv, decode::bits(&wv[w0..w1]), shape, &out),
            _ => unreachable!("w is f32 or bf16 (checked above)"),
        }
    }
    Tensor::from_vec(y, (h, m, n), x.device())
}

/// A weight element [`per_head`] reads: f32, or bf16 as raw bits.
trait HeadWeight: decode::Cached {
    /// `y (M, N) = x (M, K) · wᵀ` for `w` (N, K).
    fn rows(isa: Isa, x: &[f32], k: usize, w: &[Self], y: &mut [f32]);
}

impl HeadWeight for f32 {
    fn rows(isa: Isa, x: &[f32], k: usize, w: &[f32], y: &mut [f32]) {
        simd::rows_f32(isa, x, k, w, y)
    }
}

impl HeadWeight for u16 {
    fn rows(isa: Isa, x: &[f32], k: usize, w: &[u16], y: &mut [f32]) {
        // As a bf16 linear reads x on this CPU (`matvec`): rounded to bf16 where it multiplies
        // bf16 pairs, else widened against w in pairs.
        match simd::bf16_pairs(isa) {
            true => simd::rows_bf16_pairs(isa, &simd::bf16_bits_of(isa, x), k, w, y),
            false => simd::rows_bf16(isa, &simd::pair_layout(x, k, |v| v), k, w, y),
        }
    }
}

/// Each head's product of [`per_head`] into its (M, N) of `out`: `x` (H, M, K), `w` (H, K, N)
/// or, with `rows`, (H, N, K). On the pool when the weights are large enough to pay for it
/// (`mla:192,rope=64`'s 221 KB of bf16 a product on SmolLM2).
fn heads<W: HeadWeight>(
    x: &[f32],
    w: &[W],
    (m, k, n, rows): (usize, usize, usize, bool),
    out: &Disjoint,
) {
    let isa = Isa::current();
    let h = x.len() / (m * k);
    let head = |i: usize| {
        let (xh, wh) = (
            &x[i * m * k..(i + 1) * m * k],
            &w[i * k * n..(i + 1) * k * n],
        );
        // SAFETY: head i alone writes its m·n values of y, which holds h·m·n.
        let yh = unsafe { std::slice::from_raw_parts_mut(out.at(i * m * n), m * n) };
        match rows {
            true => W::rows(isa, xh, k, wh, yh),
            false => decode::accumulate(isa, xh, wh, (n, n), yh),
        }
    };
    match std::mem::size_of_val(w) >= PARALLEL_BYTES {
        true => Pool::global().run(h, &head),
        false => (0..h).for_each(head),
    }
}

/// Weight bytes from which [`heads`] runs on the pool (as `matvec`'s serial bound).
const PARALLEL_BYTES: usize = 96 * 1024;
