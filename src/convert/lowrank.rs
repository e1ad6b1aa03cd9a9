//! `lowrank:R`: one rank-R latent c = D·x̃ of the attention input replaces the keys and the
//! values (before RoPE), which are rebuilt as k = U_k·c, v = U_v·c (see
//! `model::attention::LowRankAttention`). The fit picks the R directions of y = [k; v] that
//! matter most:
//!
//! - `svd`: the top R left singular vectors of [W_k; W_v] (weights alone, no calibration);
//! - `aware`: the top R eigenvectors of E[y yᵀ] over a calibration text, after weighting y
//!   by what an error in it costs the attention's output. A value error δv of K/V head g
//!   reaches the output as W_o,h·δv for each query head h reading g, so it weighs
//!   Σ_h W_o,hᵀ W_o,h. A key error δk moves the score q_h·δk, which moves the output along
//!   the values' spread, so it weighs E[q_h q_hᵀ]·tr(W_o,h Cov(v) W_o,hᵀ) / D, keeping only
//!   the part that survives RoPE's relative rotation (each pair's mean energy), times
//!   [`KEY_WEIGHT`].
//!
//! With the weight M = S², c = Vᵀ·S·y and y ≈ S⁺·V·c for V the top R eigenvectors of
//! S·E[y yᵀ]·S. At full rank (R = 2·G·D) the latent is y itself and the conversion exact.

use super::gqa::{Heads, Projections};
use super::linalg::{eigh, sqrt_and_pinv_sqrt};
use super::plan::Plan;
use super::spec::Method;
use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor};

/// The key weight relative to the derivation above. The derivation counts each score error
/// against the values' whole spread, where attention averages over fewer, closer positions;
/// 0.1 is the best of 1, 0.3, 0.1, 0.03, 0.01 for SmolLM2-135M `lowrank:128` on the last
/// third of the default calibration text, and also on held-out prose (tests/data/passage.txt:
/// ΔNLL +0.91 at 1, +0.59 at 0.1).
pub const KEY_WEIGHT: f64 = 0.1;

/// The converted layer's low-rank K/V: `down` (R, C + 1) with its bias as the last column,
/// `k_up` and `v_up` (G·D, R).
pub struct LowRank {
    pub down: Tensor,
    pub k_up: Tensor,
    pub v_up: Tensor,
}

/// Fits one layer. `moment` is E[x̃ x̃ᵀ] of the attention input with a constant 1 appended
/// (`aware` needs it; `svd` and full rank do not).
pub fn convert(
    plan: &Plan,
    heads: Heads,
    w: &Projections,
    moment: Option<&Tensor>,
) -> Result<LowRank> {
    let latent = plan
        .latent
        .ok_or_else(|| Error::Invalid("lowrank::convert needs a latent plan".into()))?;
    let (r, full) = (latent.rank, latent.full);
    let gd = full / 2;
    let y = Tensor::cat(&[&w.k, &w.v], 0)?; // (2·G·D, C + 1)
    if r == full {
        let eye = Tensor::eye(full, DType::F64, &Device::Cpu)?;
        return Ok(LowRank {
            down: y,
            k_up: eye.narrow(0, 0, gd)?,
            v_up: eye.narrow(0, gd, gd)?,
        });
    }
    let (second, weight) = match (plan.method, moment) {
        (Method::Aware, Some(m)) => (y.matmul(m)?.matmul(&y.t()?)?, weight(plan, heads, w, m)?),
        (Method::Svd, _) => (y.matmul(&y.t()?)?, identity(full)),
        _ => {
            return Err(Error::Invalid(format!(
                "--attention {}: no calibration moments for method=aware",
                plan.spec
            )))
        }
    };
    let (s, s_inv) = sqrt_and_pinv_sqrt(&weight, full);
    let s = Tensor::from_vec(s, (full, full), &Device::Cpu)?;
    let s_inv = Tensor::from_vec(s_inv, (full, full), &Device::Cpu)?;
    let z = s.matmul(&second)?.matmul(&s)?;
    let (_, vecs) = eigh(&z.flatten_all()?.to_vec1::<f64>()?, full);
    let v = Tensor::from_vec(vecs, (full, full), &Device::Cpu)?.narrow(1, 0, r)?; // (2GD, R)
    let down = v.t()?.matmul(&s)?.matmul(&y)?; // (R, C + 1)
    let up = s_inv.matmul(&v)?; // (2GD, R)
    Ok(LowRank {
        down,
        k_up: up.narrow(0, 0, gd)?,
        v_up: up.narrow(0, gd, gd)?,
    })
}

fn identity(n: usize) -> Vec<f64> {
    (0..n * n)
        .map(|k| f64::from(u8::from(k / n == k % n)))
        .collect()
}

/// The output-cost weight of y = [k; v] (module docs), (2·G·D)² row-major: diagonal over
/// the keys, one D×D block per value head.
fn weight(plan: &Plan, heads: Heads, w: &Projections, m: &Tensor) -> Result<Vec<f64>> {
    let (h, g, d) = (plan.num_heads, plan.from_kv_heads, heads.d);
    let (gd, full) = (g * d, 2 * g * d);
    let c = m.dim(0)? - 1;
    // E[q_i²] per query row, and the values' covariance (their mean is W_v·E[x̃]).
    let query_energy = (w.q.matmul(m)? * &w.q)?.sum(1)?.to_vec1::<f64>()?;
    let mean = m.narrow(1, c, 1)?; // E[x̃], (C + 1, 1)
    let cov = (m - mean.matmul(&mean.t()?)?)?;
    let cov_v = w.v.matmul(&cov)?.matmul(&w.v.t()?)?; // (GD, GD)
    let mut out = vec![0.0; full * full];
    for q in 0..h {
        let kv = q / (h / g);
        let w_o = w.o.narrow(1, q * d, d)?; // (C, D)
        let gram = w_o.t()?.matmul(&w_o)?; // (D, D)
        let cov_g = cov_v.narrow(0, kv * d, d)?.narrow(1, kv * d, d)?;
        let spread = (gram.matmul(&cov_g)?.to_vec2::<f64>()?)
            .iter()
            .enumerate()
            .map(|(i, row)| row[i])
            .sum::<f64>();
        for p in 0..d / 2 {
            let (a, b) = heads.pair(p);
            let energy = (query_energy[q * d + a] + query_energy[q * d + b]) / 2.0;
            let x = KEY_WEIGHT * energy * spread / d as f64;
            for i in [a, b] {
                let row = kv * d + i;
                out[row * full + row] += x;
            }
        }
        for (i, row) in gram.to_vec2::<f64>()?.iter().enumerate() {
            for (j, x) in row.iter().enumerate() {
                out[(gd + kv * d + i) * full + gd + kv * d + j] += x;
            }
        }
    }
    Ok(out)
}
