//! The matrix-vector product `y = x · Wᵀ` for one row `x` (K) and a row-major `W` (N, K), as a
//! candle [`CustomOp2`] on CPU storage. Rows of `W` are split into chunks that a
//! persistent [`Pool`] runs in parallel; each chunk runs a [`simd`] row kernel. Supported pairs:
//! f32 x with f32 W, bf16 x with bf16 W (x widened and put in [`simd::pair_layout`] once, W
//! widened in registers, the result rounded to bf16). Anything else is the caller's job to route to candle's matmul.

use super::pool::Pool;
use super::simd::{self, Isa};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Error, Layout, Result, Shape};
use half::bf16;
use std::sync::OnceLock;

/// Below this many weight bytes a product runs on the calling thread: the hand-off to the
/// pool would cost more than the work.
const SERIAL_BYTES: usize = 96 * 1024;
/// Chunks per pool thread: more than one lets an idle thread take over from one the OS has
/// descheduled (the machine may be shared).
const CHUNKS_PER_THREAD: usize = 4;

fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(Isa::detect)
}

/// `y`'s base pointer, shared by chunks that each write their own disjoint rows.
struct Out(*mut f32);
// SAFETY: chunks write disjoint ranges of `y`, and `Pool::run` returns only after all have
// finished, while `y` is still mutably borrowed by `matvec_rows`.
unsafe impl Sync for Out {}

/// `y[n] = dot(x, W[n])` over all rows, in parallel when `W` is large enough.
/// `w.len()` must be `y.len() * x.len()`.
pub fn matvec_rows<W: Sync>(
    x: &[f32],
    w: &[W],
    y: &mut [f32],
    kernel: fn(Isa, &[f32], &[W], &mut [f32]),
) {
    let (k, n, isa, pool) = (x.len(), y.len(), isa(), Pool::global());
    if pool.threads() <= 1 || k == 0 || std::mem::size_of_val(w) < SERIAL_BYTES {
        return kernel(isa, x, w, y);
    }
    // Whole groups of 4 rows per chunk, so only the last chunk has a ragged end.
    let rows = n
        .div_ceil(pool.threads() * CHUNKS_PER_THREAD)
        .next_multiple_of(4);
    let out = &Out(y.as_mut_ptr());
    pool.run(n.div_ceil(rows), &|i| {
        let (r0, r1) = (i * rows, ((i + 1) * rows).min(n));
        // SAFETY: r0 < r1 <= n = y.len(), and chunk i is the only writer of rows r0..r1.
        let y = unsafe { std::slice::from_raw_parts_mut(out.0.add(r0), r1 - r0) };
        kernel(isa, x, &w[r0 * k..r1 * k], y);
    });
}

/// The op: `x` (.., K) with one row in all, `W` (N, K); output (.., N) in x's dtype.
#[derive(Debug, Clone, Copy)]
pub struct MatVec;

impl MatVec {
    fn out_shape(l1: &Layout, l2: &Layout) -> Result<(usize, usize, Shape)> {
        let (n, k) = l2.shape().dims2()?;
        let dims = l1.shape().dims();
        if dims.last() != Some(&k) || l1.shape().elem_count() != k {
            return Err(Error::Msg(format!(
                "matvec: x {:?} is not one row of width {k} (weight {n}x{k})",
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
fn slice<'a, T>(data: &'a [T], l: &Layout, what: &str) -> Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => Err(Error::Msg(format!("matvec: {what} must be contiguous"))),
    }
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
        let (n, _k, shape) = Self::out_shape(l1, l2)?;
        let mut y = vec![0f32; n];
        let out = match (s1, s2) {
            (CpuStorage::F32(x), CpuStorage::F32(w)) => {
                let (x, w) = (slice(x, l1, "x")?, slice(w, l2, "weight")?);
                matvec_rows(x, w, &mut y, simd::rows_f32);
                CpuStorage::F32(y)
            }
            (CpuStorage::BF16(x), CpuStorage::BF16(w)) => {
                let x: Vec<f32> = slice(x, l1, "x")?.iter().map(|v| v.to_f32()).collect();
                let x = simd::pair_layout(&x);
                let w = slice(w, l2, "weight")?;
                // SAFETY: half::bf16 is #[repr(transparent)] over u16, so the same memory
                // read as u16 has the same length and alignment.
                let bits = unsafe { std::slice::from_raw_parts(w.as_ptr() as *const u16, w.len()) };
                matvec_rows(&x, bits, &mut y, simd::rows_bf16);
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
