//! x·wᵀ for a frozen w in the end-to-end training (the MLPs and the head). candle's matmul
//! backward computes the gradient of both of its sides, and a frozen weight's, a matrix
//! product as large as the forward's, is thrown away: this op's backward gives x's only.
//! On the CPU; elsewhere (a GPU trains in seconds) candle's matmul. (Our own kernels
//! instead of candle's matmul, with a transposed copy of w for the backward, timed the same
//! on SmolLM2, Zen 5: 32-37 s for 6 steps either way, so the copy is not made.)

use candle_core::{CpuStorage, CustomOp1, DType, Device, Error, Layout, Result, Shape};
use candle_core::{Storage, Tensor};

/// x (…, K) times wᵀ for w (N, K): (…, N).
pub fn frozen_product(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let ours = x.device().is_cpu() && x.dtype() == DType::F32 && w.dtype() == DType::F32;
    match ours {
        true => x.contiguous()?.apply_op1(Frozen(w.clone())),
        false => x.broadcast_matmul(&w.t()?),
    }
}

struct Frozen(Tensor);

impl CustomOp1 for Frozen {
    fn name(&self) -> &'static str {
        "frozen-product"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(v), Some((a, b))) = (s, l.contiguous_offsets()) else {
            return Err(Error::Msg("frozen product: x not contiguous f32".into()));
        };
        // A tensor of its own for candle's matmul, and its product copied out: two copies,
        // of x and of the result, each small beside the product's K multiply-adds a value.
        let x = Tensor::from_slice(&v[a..b], l.shape(), &Device::Cpu)?;
        let y = x.broadcast_matmul(&self.0.t()?)?;
        let (ys, yl) = y.storage_and_layout();
        let (Storage::Cpu(CpuStorage::F32(yv)), Some((a, b))) = (&*ys, yl.contiguous_offsets())
        else {
            return Err(Error::Msg(
                "frozen product: unexpected product layout".into(),
            ));
        };
        Ok((CpuStorage::F32(yv[a..b].to_vec()), yl.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(grad.broadcast_matmul(&self.0)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;

    /// The same product and the same gradient of x as candle's matmul.
    #[test]
    fn the_frozen_product_is_the_matmul_with_x_s_gradient() {
        let cpu = &Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (2, 5, 7), cpu).unwrap()).unwrap();
        let w = Tensor::randn(0f32, 1.0, (3, 7), cpu).unwrap();
        let probe = Tensor::randn(0f32, 1.0, (2, 5, 3), cpu).unwrap();
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
        let (y1, g1) = run(&|x| frozen_product(x, &w).unwrap());
        let max = |a: &Tensor, b: &Tensor| {
            let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
            d.to_scalar::<f32>().unwrap()
        };
        assert!(max(&y0, &y1) < 1e-5 && max(&g0, &g1) < 1e-5);
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
