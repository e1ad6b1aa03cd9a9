//! x·wᵀ for a frozen w in the end-to-end training (the MLPs and the head). candle's matmul
//! backward computes the gradient of both of its sides, and a frozen weight's, a matrix
//! product as large as the forward's, is thrown away: this op's backward gives x's only.
//!
//! On the CPU, where our kernels take many rows (AVX-512's tile, AVX2's), both products run
//! on them and our pool: the forward with w, the backward with a transposed copy of w made
//! once. (candle's matmul runs the `gemm` crate's AVX2 kernel on rayon's threads, which
//! candle's own pool, spinning between its ops, fought for the same two cores.) Elsewhere
//! (a GPU, a CPU with the scalar loop) candle's matmul.

use crate::model::linear::matvec::{rows_f32, slice, takes_rows};
use crate::model::linear::simd::Isa;
use candle_core::{CpuStorage, CustomOp1, DType, Error, Layout, Result, Shape};
use candle_core::{Storage, Tensor};

/// A frozen weight (N, K) and, where our kernels take its products, its transpose (K, N).
pub struct Weight {
    pub w: Tensor,
    t: Option<Tensor>,
}

impl Weight {
    pub fn new(w: Tensor) -> Result<Self> {
        // Many rows of x (2 stands for any number above one).
        let many = takes_rows(Isa::current(), 2);
        let ours = w.device().is_cpu() && w.dtype() == DType::F32 && many;
        let t = match ours {
            true => Some(w.t()?.contiguous()?),
            false => None,
        };
        Ok(Self { w, t })
    }

    /// Whether the products run on our kernels (and [`Self::transposed`] is there).
    pub fn transposed(&self) -> Option<&Tensor> {
        self.t.as_ref()
    }

    /// x (…, K) times wᵀ: (…, N), with x's gradient only.
    pub fn product(&self, x: &Tensor) -> Result<Tensor> {
        match (&self.t, x.device().is_cpu() && x.dtype() == DType::F32) {
            (Some(t), true) => x.contiguous()?.apply_op1(Frozen {
                w: self.w.clone(),
                t: t.clone(),
            }),
            _ => x.broadcast_matmul(&self.w.t()?),
        }
    }
}

/// `f` on a contiguous f32 CPU tensor's values, read in place.
pub fn in_place<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let (s, l) = t.storage_and_layout();
    match (&*s, l.contiguous_offsets()) {
        (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => Ok(f(&v[a..b])),
        _ => Err(Error::Msg(
            "frozen weight: not contiguous f32 on the CPU".into(),
        )),
    }
}

/// x·wᵀ on our kernels, without a gradient.
struct Rows(Tensor);

impl CustomOp1 for Rows {
    fn name(&self) -> &'static str {
        "frozen-rows"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(x) = s else {
            return Err(Error::Msg("frozen product: x not f32".into()));
        };
        let x = slice(x, l, "frozen product: x")?;
        let (n, k) = self.0.dims2()?;
        let dims = l.shape().dims();
        if dims.last() != Some(&k) {
            return Err(Error::Msg(format!("frozen product: x {dims:?}, w {n}x{k}")));
        }
        let mut y = vec![0f32; x.len() / k * n];
        in_place(&self.0, |w| rows_f32(x, k, w, &mut y))?;
        let mut out = dims.to_vec();
        *out.last_mut().expect("x has a last dimension") = n;
        Ok((CpuStorage::F32(y), Shape::from(out)))
    }
}

/// The forward with w, the backward with its transpose t.
struct Frozen {
    w: Tensor,
    t: Tensor,
}

impl CustomOp1 for Frozen {
    fn name(&self) -> &'static str {
        "frozen-product"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        Rows(self.w.clone()).cpu_fwd(s, l)
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(
            grad.contiguous()?.apply_op1_no_bwd(&Rows(self.t.clone()))?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use candle_core::Var;

    /// The same product and the same gradient of x as candle's matmul.
    #[test]
    fn the_frozen_product_is_the_matmul_with_x_s_gradient() {
        let cpu = &Device::Cpu;
        // Rows, columns and depth off every kernel's tile.
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (2, 37, 67), cpu).unwrap()).unwrap();
        let w = Tensor::randn(0f32, 1.0, (45, 67), cpu).unwrap();
        let probe = Tensor::randn(0f32, 1.0, (2, 37, 45), cpu).unwrap();
        let run = |f: &dyn Fn(&Tensor) -> Tensor| {
            let y = f(x.as_tensor());
            let grads = (&y * &probe)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            (y, grads.get(x.as_tensor()).unwrap().clone())
        };
        let (y0, g0) = run(&|x| x.broadcast_matmul(&w.t().unwrap()).unwrap());
        let frozen = Weight::new(w.clone()).unwrap();
        if frozen.transposed().is_none() {
            eprintln!("note: candle's matmul on both sides: no kernel of ours for many rows here");
        }
        let (y1, g1) = run(&|x| frozen.product(x).unwrap());
        let max = |a: &Tensor, b: &Tensor| {
            let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
            d.to_scalar::<f32>().unwrap()
        };
        assert!(max(&y0, &y1) < 1e-4 && max(&g0, &g1) < 1e-4);
        assert!(
            g1.abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
                > 1.0
        );
    }
}
