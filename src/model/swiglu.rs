//! The dense feed-forward block: `down_proj(silu(gate_proj(x)) * up_proj(x))`, a layer's MLP
//! in Llama-family models and each expert of a mixture of experts.

use super::attention::decode::exp;
use super::cpu::f32_rows;
use super::linear::simd::Isa;
use super::linear::{forward_each, linear_b, quantize_all, Linear, Quantizer};
use super::pool::each_row;
use candle_core::{CpuStorage, CustomOp2, DType, Error, Layout, Module, Result, Shape, Tensor};
use candle_nn::VarBuilder;

/// `down_proj(silu(gate_proj(x)) * up_proj(x))`.
#[derive(Debug, Clone)]
pub struct SwiGlu {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl SwiGlu {
    pub fn new(hidden: usize, intermediate: usize, bias: bool, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            gate_proj: linear_b(hidden, intermediate, bias, vb.pp("gate_proj"))?,
            up_proj: linear_b(hidden, intermediate, bias, vb.pp("up_proj"))?,
            down_proj: linear_b(intermediate, hidden, bias, vb.pp("down_proj"))?,
        })
    }

    /// Quantizes the three projections (see [`Linear::quantize`]); returns the bytes saved.
    pub fn quantize(&mut self, q: &dyn Quantizer) -> Result<usize> {
        quantize_all(
            &mut [&mut self.gate_proj, &mut self.up_proj, &mut self.down_proj],
            q,
        )
    }

    /// Builds an expert from weights already in memory (transformers' fused expert tensors).
    pub fn from_weights(gate: Tensor, up: Tensor, down: Tensor) -> Self {
        Self {
            gate_proj: Linear::new(gate, None),
            up_proj: Linear::new(up, None),
            down_proj: Linear::new(down, None),
        }
    }
}

impl Module for SwiGlu {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let [gate, up] = forward_each(x, [&self.gate_proj, &self.up_proj])?;
        let ours = gate.device().is_cpu()
            && [&gate, &up]
                .iter()
                .all(|t| t.dtype() == DType::F32 && t.is_contiguous())
            && gate.dims() == up.dims()
            && gate.rank() > 0;
        let h = match ours {
            true => gate.apply_op2_no_bwd(&up, &SiluMul)?,
            false => (candle_nn::ops::silu(&gate)? * up)?,
        };
        self.down_proj.forward(&h)
    }
}

/// `silu(gate) · up` on CPU in f32, in one pass, with the decode op's vectorized exponential
/// (candle's SiLU calls libm's `expf` per value and is a pass of its own, the product
/// another: on the AVX2 host a 512-token prompt of SmolLM2-135M Q4_0 spent 7% of its
/// prefill in `expf`). Rows over [`crate::model::pool::Pool`] for prompts.
struct SiluMul;

impl CustomOp2 for SiluMul {
    fn name(&self) -> &'static str {
        "silu-mul"
    }

    fn cpu_fwd(
        &self,
        gs: &CpuStorage,
        gl: &Layout,
        us: &CpuStorage,
        ul: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let g = f32_rows(gs, gl, "silu-mul: gate")?;
        let (mut out, up) = (g.to_vec(), f32_rows(us, ul, "silu-mul: up")?);
        let d = gl.dims().last().copied().unwrap_or(0);
        if d == 0 || up.len() != out.len() {
            return Err(Error::Msg(format!(
                "silu-mul: {:?} against {:?}",
                gl.dims(),
                ul.dims()
            )));
        }
        let isa = Isa::current();
        each_row(&mut out, d, |r, row| silu_mul(isa, row, &up[r * d..][..d]));
        Ok((CpuStorage::F32(out), gl.shape().clone()))
    }
}

/// `row = silu(row) · up`, vectorized for AVX-512 or AVX2 where the CPU has it (the same
/// operations on every value, so the same results).
fn silu_mul(isa: Isa, row: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa.kind() == super::linear::simd::IsaKind::Avx512 {
        // SAFETY: an `Isa` of this kind exists only on a CPU with AVX-512F, AVX2 and FMA.
        return unsafe { silu_mul_avx512(row, up) };
    }
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() {
        // SAFETY: an `Isa` of these kinds exists only on a CPU with AVX2 and FMA.
        return unsafe { silu_mul_avx2(row, up) };
    }
    let _ = isa;
    silu_mul_plain(row, up)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_avx2(row: &mut [f32], up: &[f32]) {
    silu_mul_plain(row, up)
}

/// [`silu_mul_plain`] compiled for AVX-512: 16 values a vector. SmolLM2-135M Q4_0, `bench
/// --batch 8` (Zen 5): a step's 30 SiLUs of 8 rows 203 -> 113 us.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn silu_mul_avx512(row: &mut [f32], up: &[f32]) {
    silu_mul_plain(row, up)
}

/// silu(x) = x · sigmoid(x), sigmoid from e = exp(-|x|) in (0, 1]: 1 / (1 + e) for x >= 0,
/// e / (1 + e) below, so the exponential never overflows.
#[inline(always)]
fn silu_mul_plain(row: &mut [f32], up: &[f32]) {
    for (x, u) in row.iter_mut().zip(up) {
        let e = exp(-x.abs());
        let s = if *x >= 0.0 { 1.0 } else { e } / (1.0 + e);
        *x = *x * s * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fused form against libm's `x / (1 + e^-x) · u` over [-100, 100], on every ISA
    /// this CPU has.
    #[test]
    fn silu_mul_matches_libm() {
        let xs: Vec<f32> = (0..4001).map(|i| (i as f32 - 2000.0) / 20.0).collect();
        let up: Vec<f32> = (0..xs.len()).map(|i| 1.0 + (i % 7) as f32 / 4.0).collect();
        for isa in Isa::supported() {
            let mut row = xs.clone();
            silu_mul(isa, &mut row, &up);
            for ((got, x), u) in row.iter().zip(&xs).zip(&up) {
                let want = (*x as f64 / (1.0 + (-*x as f64).exp()) * *u as f64) as f32;
                let err = (got - want).abs() / want.abs().max(1e-30);
                assert!(
                    err < 1e-6 || (got - want).abs() < 1e-30,
                    "silu({x}) · {u}: {got} vs {want}"
                );
            }
        }
    }
}
