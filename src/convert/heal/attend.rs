//! Attention once more, in candle's differentiable basic ops, for fitting only: over
//! windows that start at position 0, whose keys and values come from their own projections
//! (`gqa:G`, `mqa`), from one latent (`lowrank:R`: k = U_k·D·x̃, v = U_v·D·x̃), or from
//! MLA's latent and shared RoPE key (`mla:R,rope=W`, in its expanded form), as the engine
//! runs them (`model::attention`).

use super::{batch, Geometry};
use crate::error::Result;
use candle_core::{DType, Device, Tensor, D};

/// One converted layer's attention in the form healing fits, in f64 like the conversions:
/// projections (rows, C + 1) with their bias as the last column, `o` (C, H·D).
#[derive(Debug, Clone)]
pub enum Form {
    /// K/V heads with projections of their own.
    Gqa {
        q: Tensor,
        k: Tensor,
        v: Tensor,
        o: Tensor,
    },
    /// Keys and values rebuilt from one latent: `down` (R, C + 1), `k_up`/`v_up` (G·D, R).
    LowRank {
        q: Tensor,
        down: Tensor,
        k_up: Tensor,
        v_up: Tensor,
        o: Tensor,
    },
    /// MLA as [`crate::convert::mla::Mla`] leaves it, before DeepSeek's layout (if asked)
    /// adds its anchor channel and latent norm (`convert::deepseek`, a fixed scale there):
    /// `q` (H·(D + W), C + 1), each head's rows its D "nope" rows then W RoPE rows; `kv_a`
    /// (R + W, C + 1), the latent's rows then the RoPE key's (W / D heads of D, shared by
    /// every query head); `kv_b` (H·2D, R), each head's key rows then its value rows (R one
    /// less than asked in DeepSeek's layout).
    Mla {
        q: Tensor,
        kv_a: Tensor,
        kv_b: Tensor,
        o: Tensor,
    },
}

impl Form {
    pub(super) fn tensors(&self) -> Vec<&Tensor> {
        match self {
            Form::Gqa { q, k, v, o } => vec![q, k, v, o],
            Form::LowRank {
                q,
                down,
                k_up,
                v_up,
                o,
            } => vec![q, down, k_up, v_up, o],
            Form::Mla { q, kv_a, kv_b, o } => vec![q, kv_a, kv_b, o],
        }
    }

    /// The same form with `ts` (in [`Self::tensors`]' order) in place of its tensors.
    pub(super) fn with(&self, ts: &[Tensor]) -> Self {
        match self {
            Form::Gqa { .. } => Form::Gqa {
                q: ts[0].clone(),
                k: ts[1].clone(),
                v: ts[2].clone(),
                o: ts[3].clone(),
            },
            Form::LowRank { .. } => Form::LowRank {
                q: ts[0].clone(),
                down: ts[1].clone(),
                k_up: ts[2].clone(),
                v_up: ts[3].clone(),
                o: ts[4].clone(),
            },
            Form::Mla { .. } => Form::Mla {
                q: ts[0].clone(),
                kv_a: ts[1].clone(),
                kv_b: ts[2].clone(),
                o: ts[3].clone(),
            },
        }
    }

    /// The same form with every tensor in `dtype` on `device`.
    pub(crate) fn to(&self, dtype: DType, device: &Device) -> Result<Self> {
        let ts = self
            .tensors()
            .into_iter()
            .map(|t| t.to_dtype(dtype)?.to_device(device))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(self.with(&ts))
    }

    pub(super) fn o(&self) -> &Tensor {
        match self {
            Form::Gqa { o, .. } | Form::LowRank { o, .. } | Form::Mla { o, .. } => o,
        }
    }

    /// The same form with another output projection.
    pub(super) fn with_o(&self, o: Tensor) -> Self {
        let mut ts: Vec<Tensor> = self.tensors().into_iter().cloned().collect();
        let last = ts.len() - 1;
        ts[last] = o;
        self.with(&ts)
    }
}

/// `f` over `inputs` (N, T, C + 1) a few windows at a time, the results joined along the
/// first dim.
pub fn in_batches(inputs: &Tensor, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let (n, t, _) = inputs.dims3()?;
    let b = batch(t);
    let parts = (0..n)
        .step_by(b)
        .map(|i| f(&inputs.narrow(0, i, b.min(n - i))?))
        .collect::<Result<Vec<_>>>()?;
    Ok(Tensor::cat(&parts, 0)?)
}

/// 0 on and below the diagonal, -∞ above: (T, T).
pub fn mask(t: usize, dev: &Device) -> Result<Tensor> {
    let m: Vec<f32> = (0..t * t)
        .map(|i| match i % t > i / t {
            true => f32::NEG_INFINITY,
            false => 0.0,
        })
        .collect();
    Ok(Tensor::from_vec(m, (t, t), dev)?)
}

/// The attention's output (B, T, C) for x (B, T, C + 1), before any `o_proj` bias.
pub fn output(f: &Form, x: &Tensor, geo: &Geometry, mask: &Tensor) -> Result<Tensor> {
    Ok(attend(f, x, geo, mask)?.broadcast_matmul(&f.o().t()?)?)
}

/// The heads' outputs before `o_proj`, (B, T, H·D), for x (B, T, C + 1): attention with
/// RoPE over each window from position 0, in differentiable ops.
pub fn attend(f: &Form, x: &Tensor, geo: &Geometry, mask: &Tensor) -> Result<Tensor> {
    let (b, t, _) = x.dims3()?;
    let (h, d) = (geo.num_heads, geo.head_dim);
    let (p, v) = weights(f, x, geo, mask)?;
    let y = p.matmul(&v)?.reshape((b, h, t, d))?.transpose(1, 2)?;
    Ok(y.reshape((b, t, h * d))?)
}

/// The attention's probabilities for x (B, T, C + 1), (B, G, (H/G)·T, T) with query head
/// g·(H/G) + i at rows i·T.., and the values they weigh, (B, G, T, D).
pub fn weights(f: &Form, x: &Tensor, geo: &Geometry, mask: &Tensor) -> Result<(Tensor, Tensor)> {
    let (b, t, c1) = x.dims3()?;
    let (h, d) = (geo.num_heads, geo.head_dim);
    let flat = x.reshape((b * t, c1))?;
    let flat = match geo.bias {
        true => flat,
        false => flat.narrow(1, 0, c1 - 1)?.contiguous()?,
    };
    // (rows, C + 1) -> (B, n, T, rows / n)
    let heads = |w: &Tensor, n: usize| -> Result<Tensor> {
        let y = project(&flat, w)?.reshape((b, t, n, ()))?;
        Ok(y.transpose(1, 2)?.contiguous()?)
    };
    let rope = |x: &Tensor| geo.rotation.apply_differentiable(x);
    let (q, k, v) = match f {
        Form::Gqa { q, k, v, .. } => (
            rope(&heads(q, h)?)?,
            rope(&heads(k, k.dim(0)? / d)?)?,
            heads(v, v.dim(0)? / d)?,
        ),
        Form::LowRank {
            q,
            down,
            k_up,
            v_up,
            ..
        } => {
            let (k, v) = (k_up.matmul(down)?, v_up.matmul(down)?);
            (
                rope(&heads(q, h)?)?,
                rope(&heads(&k, k.dim(0)? / d)?)?,
                heads(&v, v.dim(0)? / d)?,
            )
        }
        Form::Mla { q, kv_a, kv_b, .. } => {
            let r = kv_b.dim(1)?;
            let w = kv_a.dim(0)? - r;
            // The RoPE parts as W / D heads of D, each rotated as one of the original's.
            let rope_heads = |x: &Tensor| -> Result<Tensor> {
                let n = x.dim(1)?;
                let x = x
                    .reshape((b, n, t, w / d, d))?
                    .transpose(2, 3)?
                    .contiguous()?;
                let x = rope(&x.reshape((b, n * (w / d), t, d))?)?;
                Ok(x.reshape((b, n, w / d, t, d))?
                    .transpose(2, 3)?
                    .reshape((b, n, t, w))?)
            };
            let q = heads(q, h)?;
            let (q_nope, q_pe) = (
                q.narrow(3, 0, d)?,
                rope_heads(&q.narrow(3, d, w)?.contiguous()?)?,
            );
            let latent = heads(kv_a, 1)?; // (B, 1, T, R + W)
            let k_pe = rope_heads(&latent.narrow(3, r, w)?.contiguous()?)?;
            let c_kv = latent.narrow(3, 0, r)?.contiguous()?;
            let up = c_kv.broadcast_matmul(&kv_b.t()?)?; // (B, 1, T, H·2D)
            let up = up.reshape((b, t, h, 2 * d))?.transpose(1, 2)?;
            let k = Tensor::cat(
                &[&up.narrow(3, 0, d)?, &k_pe.broadcast_as((b, h, t, w))?],
                3,
            )?
            .contiguous()?;
            (
                Tensor::cat(&[&q_nope, &q_pe], 3)?,
                k,
                up.narrow(3, d, d)?.contiguous()?,
            )
        }
    };
    let g = k.dim(1)?;
    // The H/G query heads of a K/V head as one block of rows: no copies of K and V.
    let q = q.reshape((b, g, (h / g) * t, ()))?;
    let mask = mask.repeat(((h / g), 1))?;
    let scale = (q.dim(3)? as f64).sqrt();
    let scores = (q.matmul(&k.t()?)? / scale)?.broadcast_add(&mask)?;
    // The row maxima only keep exp in range: no gradient flows through them.
    let max = scores.max_keepdim(D::Minus1)?.detach();
    let e = scores.broadcast_sub(&max)?.exp()?;
    Ok((e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?, v))
}

/// x (N, C + 1), or (N, C) without biases ([`attend`]), through an augmented projection w
/// (rows, C + 1): without biases its weight columns alone, so the bias column, which a
/// checkpoint without biases does not get, cannot train. (Contiguous operands: candle's
/// CUDA matmul takes no row stride wider than the row.)
fn project(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let w = match x.dim(1)? == w.dim(1)? {
        true => w.clone(),
        false => w.narrow(1, 0, x.dim(1)?)?.contiguous()?,
    };
    Ok(x.matmul(&w.t()?)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use crate::convert::gqa::{Heads, Projections};
    use crate::convert::{mla, spec::Spec};
    use crate::model::rope::Rope;
    use std::path::Path;

    /// With a RoPE head per K/V head (W = G·D) nothing is left of the keys for the latent,
    /// and a latent of the values' full rank (G·D) makes MLA exact: its form here gives the
    /// original layer's outputs (as the engine's MLA is tested to), so healing trains what
    /// the engine runs. Two query heads share each RoPE head: a wrong grouping, order of
    /// parts or scale fails it.
    #[test]
    fn an_exact_mla_conversion_attends_as_the_original() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
        let cfg = ModelConfig::from_file(&dir.join("configs/tiny-gqa.json")).unwrap();
        let (c, h, d, t) = (cfg.hidden_size, cfg.num_attention_heads, 32, 16);
        let cpu = &Device::Cpu;
        let rand = |rows: usize, cols: usize| Tensor::randn(0f64, 0.1, (rows, cols), cpu);
        let proj = |rows: usize| -> Tensor {
            let zero = Tensor::zeros((rows, 1), DType::F64, cpu).unwrap();
            Tensor::cat(&[&rand(rows, c).unwrap(), &zero], 1).unwrap()
        };
        let w = Projections {
            q: proj(h * d),
            k: proj(2 * d),
            v: proj(2 * d),
            o: rand(c, h * d).unwrap(),
        };
        let spec: Spec = "mla:64,rope=64,layout=ours,method=svd".parse().unwrap();
        let plan = spec.plan(&cfg).unwrap();
        let heads = Heads {
            d,
            interleaved: false,
        };
        let out = mla::convert(&plan, heads, &w, None, None).unwrap();
        let positions: Vec<u32> = (0..t as u32).collect();
        let geo = Geometry {
            num_heads: h,
            head_dim: d,
            rotation: Rope::new(&cfg.rope, DType::F32, cpu)
                .unwrap()
                .at_positions(&positions)
                .unwrap(),
            bias: false,
            device: cpu.clone(),
        };
        let original = Form::Gqa {
            q: w.q.clone(),
            k: w.k.clone(),
            v: w.v.clone(),
            o: w.o.clone(),
        };
        let converted = Form::Mla {
            q: out.q,
            kv_a: out.kv_a,
            kv_b: out.kv_b,
            o: w.o.clone(),
        };
        let x = Tensor::randn(0f32, 1.0, (2, t, c), cpu).unwrap();
        let x = Tensor::cat(&[&x, &Tensor::ones((2, t, 1), DType::F32, cpu).unwrap()], 2).unwrap();
        let mask = mask(t, cpu).unwrap();
        let run = |f: &Form| output(&f.to(DType::F32, cpu).unwrap(), &x, &geo, &mask).unwrap();
        let (a, b) = (run(&original), run(&converted));
        let diff = (&a - &b).unwrap().abs().unwrap().max_all().unwrap();
        let scale = a.abs().unwrap().max_all().unwrap();
        let (diff, scale) = (
            diff.to_scalar::<f32>().unwrap(),
            scale.to_scalar::<f32>().unwrap(),
        );
        assert!(diff < 1e-5 * scale.max(1.0), "{diff} of {scale}");
    }
}
