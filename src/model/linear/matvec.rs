//! The product `y = x · Wᵀ` for a few rows of `x` (M, K) and a row-major `W` (N, K), as a
//! candle [`CustomOp2`] on CPU storage: one row in every decode step, a prompt chunk in
//! prefill (on AVX-512, see [`simd::tiles_rows`]; on AVX2 a tile of 2 rows, or [`prefill`]
//! for many). Rows of `W` are split into chunks that a
//! persistent [`Pool`] runs in parallel; each chunk runs a [`simd`] kernel over all of x and
//! writes its own columns of y. Supported pairs: f32 x with f32 or bf16 W, bf16 x with bf16
//! W (x widened and put in [`simd::pair_layout`] once, bf16 W widened in registers, the
//! result in x's dtype; on AVX-512 with BF16, [`simd::bf16_pairs`], x rounded to bf16 once
//! instead, or read as it is when bf16, and W as stored). Anything else is the caller's job
//! to route to candle's matmul.

use super::prefill::{self, Weights};
use super::simd::{self, Isa, IsaKind};
use crate::model::pool::Pool;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Error, Layout, Result, Shape};
use half::bf16;

/// Below this many weight bytes × rows of x a product runs on the calling thread: the
/// hand-off to the pool would cost more than the work.
const SERIAL_BYTES: usize = 96 * 1024;
/// Chunks per pool thread, here, in the prompts' products (`prefill`) and in the packed
/// quantized ones: one contiguous run of rows each. Four (so that an idle thread could take
/// over from one the OS had descheduled) cost each thread a start of its weight stream per
/// chunk, and each product's weights outrun the caches: SmolLM2-135M decode (Zen 4, 2
/// threads, alternating rounds, medians) bf16 90.6 -> 102.4 tok/s (10 rounds), Q4_0 252 ->
/// 280 (6), Q8_0 195 -> 206 (8), f32 +3%;
/// batches of 8 and 512-token prompts within noise, the 1.7B shape's larger products alike;
/// in `prefill`, bf16 512-token prompts 1009 -> 1062 (6 rounds), f32 within noise.
/// A thread the OS deschedules mid-chunk now holds up the product for longer.
pub(in crate::model::linear) const CHUNKS_PER_THREAD: usize = 1;

/// Whether a product with `m` rows of x belongs here with the kernels of `isa`: one row with
/// explicit SIMD; several when the kernels tile them (AVX-512) or on AVX2, where a tile of 2
/// rows or [`prefill`] takes them. Never with the scalar loop: candle's matmul is faster.
pub fn takes_rows(isa: Isa, m: usize) -> bool {
    isa.kind() != IsaKind::Scalar
        && (m == 1 || (m > 1 && (simd::tiles_rows(isa) || isa.kind() == IsaKind::Avx2)))
}

/// `y`'s base pointer, shared by chunks that each write their own disjoint columns.
struct Out(*mut f32);
// SAFETY: chunks write disjoint places of `y`, and `Pool::run` returns only after all have
// finished, while `y` is still mutably borrowed by `product`.
unsafe impl Sync for Out {}

/// The strided kernels' shape: `rows(isa, x, k, w, y, ldy)`.
type Kernel<X, W> = unsafe fn(Isa, &[X], usize, &[W], *mut f32, usize);

/// `y (M, N) = x (M, K) · wᵀ` for `w` (N, K), in parallel when the work is large enough.
fn product<X: Sync, W: Sync>(x: &[X], k: usize, w: &[W], y: &mut [f32], kernel: Kernel<X, W>) {
    let (isa, pool) = (Isa::current(), Pool::global());
    if k == 0 {
        return y.fill(0.0);
    }
    let n = w.len() / k;
    assert!(
        x.len().is_multiple_of(k) && w.len().is_multiple_of(k) && y.len() == x.len() / k * n,
        "matvec: x ({}), w ({}) and y ({}) are not rows of width {k}",
        x.len(),
        w.len(),
        y.len()
    );
    let out = &Out(y.as_mut_ptr());
    let m = x.len() / k;
    if pool.threads() <= 1 || std::mem::size_of_val(w) * m < SERIAL_BYTES {
        // SAFETY: y holds M·N values (checked above), the kernel writes m·N + r for r < N.
        return unsafe { kernel(isa, x, k, w, out.0, n) };
    }
    // Whole groups of 4 rows per chunk, so only the last chunk has a ragged end.
    let rows = n
        .div_ceil(pool.threads() * CHUNKS_PER_THREAD)
        .next_multiple_of(4);
    pool.run(n.div_ceil(rows), &|i| {
        let (r0, r1) = (i * rows, ((i + 1) * rows).min(n));
        // SAFETY: chunk i alone writes columns r0..r1 of y (M rows of N), all inside y.
        unsafe { kernel(isa, x, k, &w[r0 * k..r1 * k], out.0.add(r0), n) };
    });
}

/// `y (M, N) = x (M, K) · wᵀ` for `w` (N, K), all f32 and row-major, on the kernels that
/// suit M rows here (any M; with the scalar loop only, slower than candle's matmul).
///
/// # Panics
/// If x, w and y are not M × K, N × K and M × N.
pub fn rows_f32(x: &[f32], k: usize, w: &[f32], y: &mut [f32]) {
    match prefill::by_gemm(x.len() / k.max(1), Weights::F32(w)) {
        true => prefill::product(x, k, Weights::F32(w), y),
        false => product(x, k, w, y, simd::rows_f32_strided),
    }
}

/// The op: `x` (.., K), `W` (N, K); output (.., N) in x's dtype.
#[derive(Debug, Clone, Copy)]
pub struct MatVec;

impl MatVec {
    fn out_shape(l1: &Layout, l2: &Layout) -> Result<(usize, usize, Shape)> {
        let (n, k) = l2.shape().dims2()?;
        let dims = l1.shape().dims();
        if dims.last() != Some(&k) {
            return Err(Error::Msg(format!(
                "matvec: x {:?} is not rows of width {k} (weight {n}x{k})",
                l1.shape()
            )));
        }
        let mut out = dims.to_vec();
        if let Some(last) = out.last_mut() {
            *last = n;
        }
        Ok((n, k, Shape::from(out)))
    }
}

/// The contiguous slice a layout covers, or an error naming the operand.
pub(crate) fn slice<'a, T>(data: &'a [T], l: &Layout, what: &str) -> Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => Err(Error::Msg(format!("matvec: {what} must be contiguous"))),
    }
}

/// bf16 weights as their raw bits, as the kernels read them.
fn bf16_bits(w: &[bf16]) -> &[u16] {
    // SAFETY: half::bf16 is #[repr(transparent)] over u16, so the same memory read as u16
    // has the same length and alignment.
    unsafe { std::slice::from_raw_parts(w.as_ptr() as *const u16, w.len()) }
}

impl CustomOp2 for MatVec {
    fn name(&self) -> &'static str {
        "matvec"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_n, k, shape) = Self::out_shape(l1, l2)?;
        let m = l1.shape().elem_count() / k.max(1);
        let mut y = vec![0f32; shape.elem_count()];
        let out = match (s1, s2) {
            (CpuStorage::F32(x), CpuStorage::F32(w)) => {
                let (x, w) = (slice(x, l1, "x")?, slice(w, l2, "weight")?);
                rows_f32(x, k, w, &mut y);
                CpuStorage::F32(y)
            }
            (CpuStorage::F32(x), CpuStorage::BF16(w)) => {
                let (x, w) = (slice(x, l1, "x")?, slice(w, l2, "weight")?);
                let bits = bf16_bits(w);
                let isa = Isa::current();
                if simd::bf16_pairs(isa) {
                    let x = simd::bf16_bits_of(isa, x);
                    product(&x, k, bits, &mut y, simd::rows_bf16_pairs_strided)
                } else if prefill::by_gemm(m, Weights::Bf16(bits)) {
                    prefill::product(x, k, Weights::Bf16(bits), &mut y)
                } else {
                    let x = simd::pair_layout(x, k, |v| v);
                    product(&x, k, bits, &mut y, simd::rows_bf16_strided)
                }
                CpuStorage::F32(y)
            }
            (CpuStorage::BF16(x), CpuStorage::BF16(w)) => {
                let (x, w) = (slice(x, l1, "x")?, slice(w, l2, "weight")?);
                let bits = bf16_bits(w);
                if simd::bf16_pairs(Isa::current()) {
                    product(bf16_bits(x), k, bits, &mut y, simd::rows_bf16_pairs_strided);
                } else if prefill::by_gemm(m, Weights::Bf16(bits)) {
                    let x: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
                    prefill::product(&x, k, Weights::Bf16(bits), &mut y);
                } else {
                    let x = simd::pair_layout(x, k, bf16::to_f32);
                    product(&x, k, bits, &mut y, simd::rows_bf16_strided);
                }
                CpuStorage::BF16(y.into_iter().map(bf16::from_f32).collect())
            }
            (a, b) => {
                return Err(Error::Msg(format!(
                    "matvec: unsupported dtypes x {:?}, weight {:?}",
                    a.dtype(),
                    b.dtype()
                )))
            }
        };
        Ok((out, shape))
    }
}
