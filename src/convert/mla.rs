//! `mla:R,rope=W`: a GQA layer as cacheable MLA (latent cache, absorbed decode), as
//! DeepSeek's layout with two fields of our own (`rope_groups`, `latent_norm: false`; see
//! [`crate::config::MlaConfig`]). Each query head's score q·R(Δ)·k_g is split in two:
//!
//! - a RoPE part over W / D shared "RoPE heads", merged from the original keys as
//!   `gqa:W/D` merges them (`aware`: per frequency, as complex numbers; `svd`: their mean)
//!   and rotated as usual; each query head takes its merge's complex scalars (T_h);
//! - the rest, r_g = k_g − T_hᵀ·k'_j (what the RoPE head does not rebuild of the original
//!   key), dotted with the unrotated query: MLA's "nope" part, unrotated as DeepSeek's is.
//!
//! The residual keys and the values of all K/V heads are then one `lowrank:R` latent (see
//! [`super::lowrank`]): `kv_b_proj` rebuilds each query head's residual key and value from
//! it. With W = G·D (one RoPE head per original head) the residual is zero, and at full
//! rank the conversion is exact.

use super::gqa::{self, Heads, Projections};
use super::lowrank;
use super::plan::Plan;
use super::rotation::Expected;
use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor};

/// One layer's MLA projections, each with its bias column (zero: biases are refused):
/// `q_proj` (H·(D + W), C + 1, scaled by √((D + W)/D) so that MLA's 1/√(D + W) scores as the
/// original's 1/√D), `kv_a_proj_with_mqa` (R + W, C + 1), `kv_b_proj` (H·2D, R).
pub struct Mla {
    pub q: Tensor,
    pub kv_a: Tensor,
    pub kv_b: Tensor,
}

/// `turn`: the rotation each query head expects where it attends ([`Expected`]), folded into
/// its unrotated query; without it, none (exact where a head attends to its own position).
pub fn convert(
    plan: &Plan,
    heads: Heads,
    w: &Projections,
    moment: Option<&Tensor>,
    turn: Option<&Expected>,
) -> Result<Mla> {
    let (h, g, k, d) = (
        plan.num_heads,
        plan.from_kv_heads,
        plan.to_kv_heads,
        heads.d,
    );
    if plan.latent.and_then(|l| l.rope).is_none() {
        return Err(Error::Invalid("mla::convert needs an MLA plan".into()));
    }
    // 1. The RoPE heads, and each query head's map onto them (identity unless merged).
    let maps = gqa::maps(plan, heads, w, moment)?;
    let t_q = match maps.q {
        Some(t) => t,
        None => Tensor::eye(h * d, DType::F64, &Device::Cpu)?,
    };
    let k_rope = maps.k.matmul(&w.k)?; // (k·D, C + 1)
    let rope_head = |q: usize| q / (h / k);
    let block = |t: &Tensor, q: usize| t.narrow(0, q * d, d)?.narrow(1, q * d, d);
    // 2. What the RoPE head leaves of each original key, as seen by its query heads (all of
    //    an original head's queries share one RoPE head and one map: `spec::mla_fits`).
    let residual = (0..g)
        .map(|s| {
            let q = s * (h / g);
            let rebuilt = block(&t_q, q)?
                .t()?
                .matmul(&k_rope.narrow(0, rope_head(q) * d, d)?)?;
            Ok((w.k.narrow(0, s * d, d)? - rebuilt)?)
        })
        .collect::<Result<Vec<_>>>()?;
    let q_nope = match turn {
        Some(turn) => turn.fold(&w.q, heads)?,
        None => w.q.clone(),
    };
    let nope = Projections {
        q: q_nope.clone(),
        k: Tensor::cat(&residual, 0)?,
        v: w.v.clone(),
        o: w.o.clone(),
    };
    // 3. Residual keys and values through one latent.
    let low = lowrank::convert(plan, heads, &nope, moment)?;
    // 4. DeepSeek's tensors: per query head [q_nope (its original rows); q_pe (its RoPE
    //    head's block, zero elsewhere)], and per head [W_UK; W_UV] of its original head.
    let q_pe = t_q.matmul(&w.q)?;
    let zeros = Tensor::zeros((d, w.q.dim(1)?), DType::F64, &Device::Cpu)?;
    let mut q_rows = Vec::with_capacity(h * (1 + k));
    let mut b_rows = Vec::with_capacity(2 * h);
    for q in 0..h {
        q_rows.push(q_nope.narrow(0, q * d, d)?);
        for j in 0..k {
            q_rows.push(match j == rope_head(q) {
                true => q_pe.narrow(0, q * d, d)?,
                false => zeros.clone(),
            });
        }
        let s = q / (h / g);
        b_rows.push(low.k_up.narrow(0, s * d, d)?);
        b_rows.push(low.v_up.narrow(0, s * d, d)?);
    }
    // The scores' scale: the original's 1/√D where MLA's is 1/√(D + W).
    let w_rope = plan.latent.and_then(|l| l.rope).unwrap_or(d);
    let scale = ((d + w_rope) as f64 / d as f64).sqrt();
    Ok(Mla {
        q: (Tensor::cat(&q_rows, 0)? * scale)?,
        kv_a: Tensor::cat(&[&low.down, &k_rope], 0)?,
        kv_b: Tensor::cat(&b_rows, 0)?,
    })
}
