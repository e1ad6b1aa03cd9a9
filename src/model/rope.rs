//! Rotary position embeddings: frequency tables for default, linear, llama3 and yarn scaling
//! (as transformers' `modeling_rope_utils` computes them), applied with candle-nn's kernels,
//! on CPU in f32 by `rotate_rows` below instead (see [`super::norm`] for why).

use super::cpu::f32_rows;
use super::pool::each_row;
use crate::config::{RopeConfig, RopeScaling, YarnScaling};
use candle_core::{CpuStorage, CustomOp3, DType, Device, Error, Layout, Result, Shape, Tensor};
use std::f64::consts::PI;

/// The frequencies of one model's RoPE. Angles are computed per forward for just the
/// positions it needs, so a long context costs no table.
#[derive(Debug, Clone)]
pub struct Rope {
    /// (1, dim/2) in f32, as transformers computes them.
    inv_freq: Tensor,
    /// yarn's attention factor, multiplying cos and sin (1 otherwise).
    attention_factor: f64,
    /// Pairs (2i, 2i+1) when true, (i, i + dim/2) otherwise (Llama's `rotate_half`).
    interleaved: bool,
    dtype: DType,
}

/// cos/sin for positions `pos..pos + T`, shared by every layer of one forward.
#[derive(Debug, Clone)]
pub struct Rotation {
    /// (T, dim/2) each.
    cos: Tensor,
    sin: Tensor,
    interleaved: bool,
}

/// Inverse frequencies, one per rotated pair.
pub fn inv_freq(cfg: &RopeConfig) -> Vec<f64> {
    let dim = cfg.dim;
    let base: Vec<f64> = (0..dim / 2)
        .map(|i| 1.0 / cfg.theta.powf((2 * i) as f64 / dim as f64))
        .collect();
    match &cfg.scaling {
        RopeScaling::Default => base,
        RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max,
        } => {
            let old = *original_max as f64;
            let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
        RopeScaling::Yarn(y) => yarn_inv_freq(&base, cfg, y),
    }
}

/// Blends interpolated and extrapolated frequencies over yarn's correction range.
fn yarn_inv_freq(base: &[f64], cfg: &RopeConfig, y: &YarnScaling) -> Vec<f64> {
    let dim = cfg.dim as f64;
    let correction_dim = |rotations: f64| {
        dim * (y.original_max as f64 / (rotations * 2.0 * PI)).ln() / (2.0 * cfg.theta.ln())
    };
    let (mut low, mut high) = (correction_dim(y.beta_fast), correction_dim(y.beta_slow));
    if y.truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
    if low == high {
        high += 0.001;
    }
    base.iter()
        .enumerate()
        .map(|(i, &f)| {
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let extrapolation = 1.0 - ramp;
            (f / y.factor) * (1.0 - extrapolation) + f * extrapolation
        })
        .collect()
}

impl Rope {
    pub fn new(cfg: &RopeConfig, dtype: DType, dev: &Device) -> Result<Self> {
        let attention_factor = match &cfg.scaling {
            RopeScaling::Yarn(y) => y.attention_factor,
            _ => 1.0,
        };
        let inv_freq: Vec<f32> = inv_freq(cfg).iter().map(|&f| f as f32).collect();
        let half = inv_freq.len();
        let inv_freq = Tensor::from_vec(inv_freq, (1, half), dev)?;
        Ok(Self {
            inv_freq,
            attention_factor,
            interleaved: cfg.interleaved,
            dtype,
        })
    }

    /// The rotation for tokens at the given positions, one row each (the packed tokens of a
    /// batch step, each sequence at its own position).
    pub fn at_positions(&self, positions: &[u32]) -> Result<Rotation> {
        let dev = self.inv_freq.device();
        let t = positions.len();
        let positions = Tensor::new(positions, dev)?
            .to_dtype(DType::F32)?
            .reshape((t, 1))?;
        let angles = positions.matmul(&self.inv_freq)?; // (T, dim/2), in f32 like transformers
        let cos = (angles.cos()? * self.attention_factor)?.to_dtype(self.dtype)?;
        let sin = (angles.sin()? * self.attention_factor)?.to_dtype(self.dtype)?;
        Ok(Rotation {
            cos,
            sin,
            interleaved: self.interleaved,
        })
    }
}

impl Rotation {
    /// Rotates `x` (B, H, T, D).
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        if let Some(y) = rotate_rows(x, &self.cos, &self.sin, self.interleaved) {
            return y;
        }
        let x = x.contiguous()?;
        if self.interleaved {
            candle_nn::rotary_emb::rope_i(&x, &self.cos, &self.sin)
        } else {
            candle_nn::rotary_emb::rope(&x, &self.cos, &self.sin)
        }
    }

    /// [`Self::apply`] in candle's basic ops, which carry gradients (its fused kernels do
    /// not): for fitting (`--heal`), not for running.
    pub fn apply_differentiable(&self, x: &Tensor) -> Result<Tensor> {
        if self.interleaved {
            candle_nn::rotary_emb::rope_i_slow(x, &self.cos, &self.sin)
        } else {
            candle_nn::rotary_emb::rope_slow(x, &self.cos, &self.sin)
        }
    }
}

/// RoPE of x (B, H, T, D) in any layout whose rows of D are contiguous, with cos and sin (T,
/// D/2): a contiguous (B, H, T, D), as candle-nn's `rope` (pairs `i, i + D/2`) or `rope_i`
/// (pairs `2i, 2i + 1`). Reading x as laid out saves the copy a transposed x needed first.
fn rotate_rows(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    interleaved: bool,
) -> Option<Result<Tensor>> {
    let ours = x.device().is_cpu()
        && [x, cos, sin].iter().all(|t| t.dtype() == DType::F32)
        && x.rank() == 4
        && x.stride()[3] == 1;
    ours.then(|| x.apply_op3_no_bwd(cos, sin, &RowRope { interleaved }))
}

struct RowRope {
    interleaved: bool,
}

impl CustomOp3 for RowRope {
    fn name(&self) -> &'static str {
        "rope-rows"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        cs: &CpuStorage,
        cl: &Layout,
        ss: &CpuStorage,
        sl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(x) = xs else {
            return Err(Error::Msg("rope: f32 only".into()));
        };
        let (b, h, t, d) = xl.shape().dims4()?;
        let (cos, sin) = (
            f32_rows(cs, cl, "rope: cos")?,
            f32_rows(ss, sl, "rope: sin")?,
        );
        let half = d / 2;
        if d % 2 != 0 || cos.len() != t * half || sin.len() != t * half || xl.stride()[3] != 1 {
            return Err(Error::Msg(format!(
                "rope: x {:?} against cos/sin of {} values",
                xl.dims(),
                cos.len()
            )));
        }
        let st = xl.stride();
        // Gather x's rows in (B, H, T) order, then rotate them in place.
        let mut out = Vec::with_capacity(b * h * t * d);
        for bi in 0..b {
            for hi in 0..h {
                for ti in 0..t {
                    let at = xl.start_offset() + bi * st[0] + hi * st[1] + ti * st[2];
                    out.extend_from_slice(&x[at..at + d]);
                }
            }
        }
        let interleaved = self.interleaved;
        let rotate = |r: usize, row: &mut [f32]| {
            let (c, s) = (&cos[r % t * half..][..half], &sin[r % t * half..][..half]);
            for i in 0..half {
                let (a, b) = match interleaved {
                    true => (2 * i, 2 * i + 1),
                    false => (i, i + half),
                };
                let (x1, x2) = (row[a], row[b]);
                row[a] = x1 * c[i] - x2 * s[i];
                row[b] = x1 * s[i] + x2 * c[i];
            }
        };
        each_row(&mut out, d, rotate);
        Ok((CpuStorage::F32(out), Shape::from((b, h, t, d))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// candle-nn's `rope` and `rope_i` on a transposed (strided) x, few rows and many.
    #[test]
    fn rotate_rows_matches_candle_nn() -> Result<()> {
        let dev = Device::Cpu;
        for (t, h) in [(3, 2), (700, 4)] {
            let x = Tensor::randn(0f32, 1.0, (1, t, h, 32), &dev)?.transpose(1, 2)?;
            let cos = Tensor::randn(0f32, 1.0, (t, 16), &dev)?;
            let sin = Tensor::randn(0f32, 1.0, (t, 16), &dev)?;
            for interleaved in [false, true] {
                let got = rotate_rows(&x, &cos, &sin, interleaved).expect("taken")?;
                let xc = x.contiguous()?;
                let want = match interleaved {
                    true => candle_nn::rotary_emb::rope_i(&xc, &cos, &sin)?,
                    false => candle_nn::rotary_emb::rope(&xc, &cos, &sin)?,
                };
                let diff = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert!(diff < 1e-6, "t {t}, interleaved {interleaved}: {diff}");
            }
        }
        Ok(())
    }
}
