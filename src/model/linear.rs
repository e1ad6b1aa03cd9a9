//! `Linear`: candle_nn's linear layer (same constructors, same results) whose forward takes
//! our own kernel for a single row, the case of every decode step, and (on AVX-512 and AVX2)
//! for the rows of a prompt chunk ([`prefill`] for many rows on AVX2).
//!
//! candle's general GEMM leaves most of the memory bandwidth unused at M = 1, and at small M
//! runs AVX2 code; [`matvec`](mod@matvec) is an explicit-SIMD product split over a small
//! persistent pool ([`matvec::MatVec`]). Every other case (CUDA, dtypes other than f32/bf16, a non-contiguous
//! weight, several rows on a CPU with neither AVX-512 nor AVX2, any row without AVX2) is
//! candle's matmul exactly as `candle_nn::Linear` runs it ([`route`]).

pub mod matvec;
pub mod prefill;
pub mod quant;
mod quantizer;
pub mod simd;

use candle_core::quantized::QTensor;
use candle_core::{CpuStorage, DType, Module, Result, Storage, Tensor, D};
use candle_nn::VarBuilder;
use quant::QWeight;
pub use quantizer::{
    is_head, our_format, quantize_all, stored_weight, Blocks, Quantizer, StoredBlocks,
};
use simd::Isa;
use std::sync::Arc;

#[derive(Clone, Debug)]
pub struct Linear {
    weight: Weight,
    /// (out_features,), added after the product.
    bias: Option<Tensor>,
    /// The weight's name in the checkpoint, when loaded by name: how a [`Quantizer`] finds
    /// its blocks.
    name: Option<String>,
}

#[derive(Clone, Debug)]
enum Weight {
    /// (out_features, in_features), as in the checkpoint. The fast path needs it contiguous
    /// (it is, as loaded); a strided weight silently takes candle's matmul instead.
    Dense(Tensor),
    /// In Q8_0 or Q4_0 on CPU ([`Linear::quantize`]), multiplied by our kernels ([`quant`]).
    Blocks(Arc<QWeight>),
    /// In one of ggml's block formats on other devices, multiplied by candle's kernels.
    Quantized(Arc<QTensor>),
}

impl Linear {
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self {
            weight: Weight::Dense(weight),
            bias,
            name: None,
        }
    }

    /// A layer whose weight is `q`'s blocks (shared: a tied LM head and the embedding).
    pub fn from_blocks(q: Arc<QWeight>, name: impl Into<String>) -> Self {
        Self {
            weight: Weight::Blocks(q),
            bias: None,
            name: Some(name.into()),
        }
    }

    /// This layer, its weight named `name` in the checkpoint.
    pub fn named(self, name: impl Into<String>) -> Self {
        Self {
            name: Some(name.into()),
            ..self
        }
    }

    /// The weight, unless it has been quantized.
    pub fn weight(&self) -> Option<&Tensor> {
        match &self.weight {
            Weight::Dense(w) => Some(w),
            Weight::Blocks(_) | Weight::Quantized(_) => None,
        }
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// Bytes the weight occupies (blocks with their scales when quantized).
    pub fn weight_bytes(&self) -> usize {
        match &self.weight {
            Weight::Dense(w) => w.elem_count() * w.dtype().size_in_bytes(),
            Weight::Blocks(q) => q.bytes(),
            Weight::Quantized(q) => q.storage_size_in_bytes(),
        }
    }

    /// Stores the weight in the blocks `quantizer` gives for it (e.g. Q8_0: 32 weights and
    /// one f16 scale per block, as llama.cpp's quantization makes them), and returns whether
    /// it did: a weight whose rows are not whole blocks, or for which the quantizer has none,
    /// stays as it is. On CPU, Q8_0, Q4_0 and Q4_1 go to our kernels ([`quant`]); other
    /// formats (the K-quants of a GGUF file), and every format on other devices, to candle's.
    pub fn quantize(&mut self, quantizer: &dyn Quantizer) -> Result<bool> {
        let Weight::Dense(w) = &self.weight else {
            return Ok(false);
        };
        // A loader's stand-in for blocks still to come (one value broadcast: see
        // `GgufTensors::deferred`) must be replaced here, never run.
        let stand_in = w.elem_count() > 1 && w.stride().iter().all(|&s| s == 0);
        let not_taken = || {
            candle_core::Error::Msg(format!(
                "{}: the file's blocks for this weight were not taken",
                self.name.as_deref().unwrap_or("a weight")
            ))
        };
        let Some(blocks) = quantizer.blocks(self.name.as_deref())? else {
            return match stand_in {
                true => Err(not_taken()),
                false => Ok(false),
            };
        };
        let q = match &blocks {
            Blocks::Made(q) => *q,
            Blocks::Stored(t) => t.dtype,
        };
        if w.rank() != 2 || !w.dim(1)?.is_multiple_of(q.block_size()) {
            return match stand_in {
                true => Err(not_taken()),
                false => Ok(false),
            };
        }
        let (dev, (rows, cols)) = (w.device().clone(), w.dims2()?);
        let ours = our_format(q).filter(|_| dev.is_cpu());
        let unreadable =
            |what: &str| candle_core::Error::Msg(format!("cannot read {what} as {q:?}"));
        self.weight = match (blocks, ours) {
            (Blocks::Made(_), Some(format)) => {
                let data = w.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                let q =
                    QWeight::quantize(format, &data, cols).ok_or_else(|| unreadable("weight"))?;
                Weight::Blocks(Arc::new(q))
            }
            (Blocks::Made(q), None) => Weight::Quantized(Arc::new(QTensor::quantize(w, q)?)),
            (Blocks::Stored(t), _) if t.dims != [rows, cols] => {
                return Err(candle_core::Error::Msg(format!(
                    "stored blocks {:?} do not match the weight's shape {:?}",
                    t.dims,
                    w.shape()
                )))
            }
            (Blocks::Stored(t), Some(format)) => {
                Weight::Blocks(Arc::new(t.weight(format, (rows, cols))?))
            }
            (Blocks::Stored(t), None) => Weight::Quantized(Arc::new(t.into_qtensor(&dev)?)),
        };
        Ok(true)
    }
}

impl From<candle_nn::Linear> for Linear {
    fn from(l: candle_nn::Linear) -> Self {
        Self::new(l.weight().clone(), l.bias().cloned())
    }
}

/// `in_dim -> out_dim`, with a bias when `bias`: candle_nn's loader and initialisers.
pub fn linear_b(in_dim: usize, out_dim: usize, bias: bool, vb: VarBuilder) -> Result<Linear> {
    let name = format!("{}.weight", vb.prefix());
    candle_nn::linear_b(in_dim, out_dim, bias, vb).map(|l| Linear::from(l).named(name))
}

/// `in_dim -> out_dim` without a bias.
pub fn linear_no_bias(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    linear_b(in_dim, out_dim, false, vb)
}

/// Which product runs `x · wᵀ`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Our kernel, [`matvec::MatVec`].
    Kernel,
    /// candle's matmul, as `candle_nn::Linear` runs it.
    Candle,
}

/// Where `x · wᵀ` goes when the kernels run `isa` ([`Isa::current`] in [`matvec`](mod@matvec)).
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

/// `y = x · Wᵀ` for block-format weights: a prompt-sized x through `gemm` on dequantized
/// blocks (`prefill`), fewer rows through the integer kernels (`quant`).
pub fn blocks_product(q: &QWeight, x: &[f32], y: &mut [f32]) {
    let m = x.len() / q.cols().max(1);
    match prefill::by_gemm(m, prefill::Weights::Blocks(q)) {
        true => prefill::product(x, q.cols(), prefill::Weights::Blocks(q), y),
        false => q.product(x, y),
    }
}

/// Rows of x up to which candle's quantized product runs its vector kernel.
const CANDLE_VEC_ROWS: usize = 8;
/// The narrowest weight rows candle's quantized matrix kernel (past [`CANDLE_VEC_ROWS`])
/// is given: see `forward`.
const CANDLE_MMQ_MIN_K: usize = 256;

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = match &self.weight {
            Weight::Dense(w) => matvec(x, w)?,
            Weight::Blocks(q) => {
                let y = with_blocks_x(x, q, |xs| {
                    let mut y = vec![0f32; xs.len() / q.cols() * q.rows()];
                    blocks_product(q, xs, &mut y);
                    y
                })?;
                blocks_y(y, x, q)?
            }
            // candle's kernels are given (rows, K) in f32 on every device: its CPU kernels
            // take f32 rows, and on CUDA the product it falls back to, for shapes its fast
            // kernels do not take, reads only f32 in (M, K) or (B, M, K).
            Weight::Quantized(q) => {
                let (n, k) = q.shape().dims2()?;
                let mut dims = x.dims().to_vec();
                if let Some(last) = dims.last_mut() {
                    *last = n;
                }
                let x2 = x
                    .flatten_to(D::Minus2)?
                    .to_dtype(DType::F32)?
                    .contiguous()?; // (rows, K)
                let y = match x2.dim(0)? > CANDLE_VEC_ROWS && k < CANDLE_MMQ_MIN_K {
                    // candle 0.11's CUDA MMQ kernel (more than 8 rows) returned NaN for
                    // narrow rows on an H200 (2026-11-26): a Q8_0 weight 64 wide, and a
                    // Q4_0 model whose only product through it was 128 wide (a random
                    // 64 x 128 Q4_0 weight was right); 576 and 1536 wide were right. The
                    // weight is dequantized instead.
                    true => x2.matmul(&q.dequantize(x.device())?.t()?)?,
                    false => x2.apply_op1_no_bwd(q.as_ref())?,
                };
                y.to_dtype(x.dtype())?.reshape(dims)?
            }
        };
        self.add_bias(y)
    }
}

impl Linear {
    fn add_bias(&self, y: Tensor) -> Result<Tensor> {
        match &self.bias {
            None => Ok(y),
            Some(bias) => y.broadcast_add(&bias.to_dtype(y.dtype())?),
        }
    }
}

/// `f` of x's rows in f32 (a product with block weights `q`).
fn with_blocks_x<R>(x: &Tensor, q: &QWeight, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    if x.dims().last() != Some(&q.cols()) {
        return Err(candle_core::Error::Msg(format!(
            "quantized linear: x {:?} is not rows of width {}",
            x.shape(),
            q.cols()
        )));
    }
    // Read in place where x is contiguous f32 on the CPU (a batched step's every product
    // copied its x: 4 copies a layer); a read lock, and nothing writes x meanwhile.
    if x.dtype() == DType::F32 {
        let (storage, layout) = x.storage_and_layout();
        if let (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) =
            (&*storage, layout.contiguous_offsets())
        {
            return Ok(f(&v[a..b]));
        }
    }
    Ok(f(&x
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?))
}

/// `y`, the product of x's rows with block weights `q`, as a tensor shaped and typed as x.
fn blocks_y(y: Vec<f32>, x: &Tensor, q: &QWeight) -> Result<Tensor> {
    let mut dims = x.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = q.rows();
    }
    Tensor::from_vec(y, dims, &candle_core::Device::Cpu)?.to_dtype(x.dtype())
}

/// `layer.forward(x)` for each of `layers`, all given the same x (a layer's q, k and v; its
/// gate and up), in one product where all hold block weights and x has few rows
/// ([`QWeight::products`]: one rounding of x, one pass over the pool; SmolLM2's Q4_0 file
/// at `bench --batch 8`: 723 -> 824 tok/s, Zen 4); else one by one.
pub fn forward_each<const N: usize>(x: &Tensor, layers: [&Linear; N]) -> Result<[Tensor; N]> {
    <[Tensor; N]>::try_from(products_of(x, &layers)?)
        .map_err(|_| candle_core::Error::Msg("forward_each: one product a layer".into()))
}

/// [`forward_each`]'s products, in the layers' order.
fn products_of(x: &Tensor, layers: &[&Linear]) -> Result<Vec<Tensor>> {
    let blocks: Option<Vec<&QWeight>> = (layers.iter())
        .map(|l| match &l.weight {
            Weight::Blocks(q) => Some(&**q),
            _ => None,
        })
        .collect();
    let cols = x.dims().last().copied().unwrap_or(0);
    let m = x.elem_count() / cols.max(1);
    let together = blocks.filter(|qs| {
        qs.len() > 1
            && cols > 0
            && (qs.iter())
                .all(|q| q.cols() == cols && !prefill::by_gemm(m, prefill::Weights::Blocks(q)))
    });
    let Some(qs) = together else {
        return layers.iter().map(|l| l.forward(x)).collect();
    };
    let ys = with_blocks_x(x, qs[0], |xs| {
        let mut ys: Vec<Vec<f32>> = qs.iter().map(|q| vec![0f32; m * q.rows()]).collect();
        QWeight::products(
            &qs,
            xs,
            &mut ys.iter_mut().map(|y| &mut y[..]).collect::<Vec<_>>(),
        );
        ys
    })?;
    (ys.into_iter().zip(qs).zip(layers))
        .map(|((y, q), l)| l.add_bias(blocks_y(y, x, q)?))
        .collect()
}
