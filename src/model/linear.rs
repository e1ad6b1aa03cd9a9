//! `Linear`: candle_nn's linear layer (same constructors, same results) whose forward takes
//! our own kernel for a single row, the case of every decode step, and (on AVX-512 and AVX2)
//! for the rows of a prompt chunk ([`prefill`] for many rows on AVX2).
//!
//! candle's general GEMM leaves most of the memory bandwidth unused at M = 1, and at small M
//! runs AVX2 code; [`matvec`] is an explicit-SIMD product split over a small persistent pool
//! ([`matvec::MatVec`]). Every other case (CUDA, dtypes other than f32/bf16, a non-contiguous
//! weight, several rows on a CPU with neither AVX-512 nor AVX2, any row without AVX2) is
//! candle's matmul exactly as `candle_nn::Linear` runs it ([`route`]).

pub mod matvec;
pub mod prefill;
pub mod simd;

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::VarBuilder;
use simd::Isa;

#[derive(Clone, Debug)]
pub struct Linear {
    /// (out_features, in_features), as in the checkpoint. The fast path needs it contiguous
    /// (it is, as loaded); a strided weight silently takes candle's matmul instead.
    weight: Tensor,
    /// (out_features,), added after the product.
    bias: Option<Tensor>,
}

impl Linear {
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self { weight, bias }
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }
}

impl From<candle_nn::Linear> for Linear {
    fn from(l: candle_nn::Linear) -> Self {
        Self::new(l.weight().clone(), l.bias().cloned())
    }
}

/// `in_dim -> out_dim`, with a bias when `bias`: candle_nn's loader and initialisers.
pub fn linear_b(in_dim: usize, out_dim: usize, bias: bool, vb: VarBuilder) -> Result<Linear> {
    candle_nn::linear_b(in_dim, out_dim, bias, vb).map(Linear::from)
}

/// `in_dim -> out_dim` without a bias.
pub fn linear_no_bias(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    candle_nn::linear_no_bias(in_dim, out_dim, vb).map(Linear::from)
}

/// Which product runs `x · wᵀ`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Our kernel, [`matvec::MatVec`].
    Kernel,
    /// candle's matmul, as `candle_nn::Linear` runs it.
    Candle,
}

/// Where `x · wᵀ` goes when the kernels run `isa` ([`Isa::current`] in [`matvec`]).
pub fn route(isa: Isa, x: &Tensor, w: &Tensor) -> Route {
    let k = x.dims().last().copied().unwrap_or(0);
    let kernel = x.device().is_cpu()
        && k > 0
        && matvec::takes_rows(isa, x.elem_count() / k)
        && w.rank() == 2
        && w.dim(1).ok() == Some(k)
        && w.is_contiguous()
        && matches!(
            (x.dtype(), w.dtype()),
            (DType::F32, DType::F32) | (DType::F32 | DType::BF16, DType::BF16)
        );
    if kernel {
        Route::Kernel
    } else {
        Route::Candle
    }
}

/// `x · wᵀ` for x (.., K) and w (N, K), in x's dtype: our kernel where it applies, candle's
/// matmul otherwise. x may be f32 with bf16 weights (see [`crate::model::activation_dtype`]).
pub fn matvec(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    match route(Isa::current(), x, w) {
        Route::Kernel => x.contiguous()?.apply_op2_no_bwd(w, &matvec::MatVec),
        // candle's matmul wants one dtype: the product in the weight's, the result in x's.
        Route::Candle if x.dtype() != w.dtype() => {
            candle_matmul(&x.to_dtype(w.dtype())?, w)?.to_dtype(x.dtype())
        }
        Route::Candle => candle_matmul(x, w),
    }
}

/// candle_nn::Linear's forward without the bias: reshape to 2D when contiguous, matmul.
fn candle_matmul(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    match *x.dims() {
        [b1, b2, m, k] if x.is_contiguous() => x
            .reshape((b1 * b2 * m, k))?
            .matmul(&w.t()?)?
            .reshape((b1, b2, m, ())),
        [b1, b2, _, _] => x.matmul(&w.broadcast_left((b1, b2))?.t()?),
        [b, m, k] if x.is_contiguous() => {
            x.reshape((b * m, k))?.matmul(&w.t()?)?.reshape((b, m, ()))
        }
        [b, _, _] => x.matmul(&w.broadcast_left(b)?.t()?),
        _ => x.matmul(&w.t()?),
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = matvec(x, &self.weight)?;
        match &self.bias {
            None => Ok(y),
            Some(bias) => y.broadcast_add(&bias.to_dtype(y.dtype())?),
        }
    }
}
