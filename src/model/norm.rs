//! RMSNorm on CPU rows without rayon (RoPE's CPU form, [`super::rope`], and the fused SiLU do
//! the same): candle-nn's CPU kernels spread their rows over rayon's pool, and a call from
//! outside that pool hands the work to a rayon thread and waits for it (a context switch or
//! two), after which the rayon thread spins for more work on the core our own pool's helper
//! needs. A 30-layer model's decode step makes 61 norms; a batched step 60 rotations more: on
//! the 2-core AVX2 host, 8 sequences of SmolLM2-135M Q4_0 spent 2.4 ms of a 36 ms step in
//! rotations alone. The work is small (a row of a few hundred values), so it runs in the
//! caller, or over our pool for a prompt's many rows ([`each_rows`]). Other dtypes and
//! devices keep candle-nn's kernels.

use super::cpu::f32_rows;
use super::pool::each_rows;
use candle_core::{CpuStorage, CustomOp2, DType, Error, Layout, Module, Result, Shape, Tensor};

/// candle-nn's RMSNorm (the same weight and formula), on CPU in f32 here.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    pub fn new(weight: Tensor, eps: f64) -> Self {
        Self { weight, eps }
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let ours = x.device().is_cpu()
            && x.dtype() == DType::F32
            && self.weight.dtype() == DType::F32
            && x.is_contiguous();
        match ours {
            true => x.apply_op2_no_bwd(&self.weight, &Norm(self.eps as f32)),
            false => candle_nn::RmsNorm::new(self.weight.clone(), self.eps).forward(x),
        }
    }
}

/// `x / sqrt(mean(x²) + eps) · w` per row, as candle-nn's CPU kernel computes it.
struct Norm(f32);

impl CustomOp2 for Norm {
    fn name(&self) -> &'static str {
        "rms-norm-rows"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, w) = (
            f32_rows(xs, xl, "rms-norm: x")?,
            f32_rows(ws, wl, "rms-norm: w")?,
        );
        let n = w.len();
        if xl.dims().last() != Some(&n) || n == 0 {
            return Err(Error::Msg(format!(
                "rms-norm: x {:?} is not rows of {n}",
                xl.dims()
            )));
        }
        let mut out = x.to_vec();
        each_rows(&mut out, n, ROWS, |_, rows| {
            let sums = squares(rows, n);
            for (row, sum2) in rows.chunks_exact_mut(n).zip(sums) {
                let m = (sum2 / n as f32 + self.0).sqrt();
                for (v, w) in row.iter_mut().zip(w) {
                    *v = *v / m * w;
                }
            }
        });
        Ok((CpuStorage::F32(out), xl.shape().clone()))
    }
}

/// Rows whose sums of squares [`squares`] runs together.
const ROWS: usize = 8;

/// Σ x² of each of up to [`ROWS`] rows of `n` values, each in its row's order, as candle-nn's
/// kernel sums it (an order the tests' perplexity bounds of block weights were measured with):
/// one row's sum is a chain of dependent adds, so the rows' chains run side by side.
/// SmolLM2-135M Q4_0, `bench --batch 8` (Zen 5): a step's 60 norms of 8 rows 235 -> 141 us.
// The loop indexes the 8 rows and their sums together.
#[allow(clippy::needless_range_loop)]
fn squares(rows: &[f32], n: usize) -> [f32; ROWS] {
    let mut sums = [0f32; ROWS];
    match rows.len() / n {
        ROWS => {
            let rows: [&[f32]; ROWS] = std::array::from_fn(|r| &rows[r * n..][..n]);
            for c in 0..n {
                for r in 0..ROWS {
                    sums[r] += rows[r][c] * rows[r][c];
                }
            }
        }
        k => {
            for (row, sum) in rows.chunks_exact(n).take(k).zip(&mut sums) {
                *sum = row.iter().map(|v| v * v).sum::<f32>();
            }
        }
    }
    sums
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The same values as candle-nn's RMSNorm, on few rows (in the caller) and many (on the
    /// pool).
    #[test]
    fn rms_norm_matches_candle_nn() -> Result<()> {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, 96, &dev)?;
        for rows in [3, 8, 13, 1000] {
            let x = Tensor::randn(0f32, 2.0, (1, rows, 96), &dev)?;
            let got = RmsNorm::new(w.clone(), 1e-5).forward(&x)?;
            let want = candle_nn::ops::rms_norm(&x, &w, 1e-5)?;
            let diff = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-6, "{rows} rows: {diff}");
        }
        Ok(())
    }

    /// [`squares`] of 8 rows side by side, and of fewer, equal each row's own sum in its
    /// order bit for bit.
    #[test]
    fn squares_sum_each_row_in_its_order() {
        let n = 37;
        let x: Vec<f32> = (0..ROWS * n)
            .map(|i| ((i * 7919) % 1013) as f32 / 97.0 - 5.0)
            .collect();
        for k in [ROWS, 5, 1] {
            let got = squares(&x[..k * n], n);
            for (r, row) in x.chunks_exact(n).take(k).enumerate() {
                let want = row.iter().fold(0f32, |s, v| s + v * v);
                assert_eq!(got[r].to_bits(), want.to_bits(), "{k} rows, row {r}");
            }
        }
    }
}
