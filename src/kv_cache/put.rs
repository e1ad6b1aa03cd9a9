//! A step's keys and values written into a cache's CPU tensors in place, in one pass each:
//! candle's way (a view of the sequence's rows, `to_dtype`, `contiguous`, `slice_set`) is
//! four ops with their buffers for a few hundred values, and a batched step writes every
//! sequence's K and V in every layer: SmolLM2-135M Q4_0, `bench --batch 8` (Zen 5), 7% of
//! the step. The values are `to_dtype`'s (half's round to nearest even).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Error, InplaceOp2, Layout, Result, Tensor};
use half::{bf16, f16};

/// Writes `src` (1, heads, T, w), f32/bf16/f16, each row contiguous (any strides between
/// them), into `dst` (1, heads, P, W), contiguous, token j at position `positions[j]` (one
/// a token: a run, or a batched step's sequences each at its own) and columns `col..col +
/// w`, in `dst`'s dtype. `None` where it does not apply (off the CPU, other dtypes, strided
/// rows): the caller writes candle's way.
pub(super) fn put(
    dst: &Tensor,
    src: &Tensor,
    positions: &[usize],
    col: usize,
) -> Option<Result<()>> {
    let fits = |t: &Tensor| matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16);
    let (d, s) = (dst.dtype(), src.dtype());
    let pair = fits(dst) && fits(src) && (d == s || d == DType::F32 || s == DType::F32);
    let rows = src.stride().last() == Some(&1);
    if !dst.device().is_cpu() || !dst.is_contiguous() || !pair || !rows {
        return None;
    }
    Some(dst.inplace_op2(src, &Put { positions, col }))
}

struct Put<'a> {
    positions: &'a [usize],
    col: usize,
}

impl InplaceOp2 for Put<'_> {
    fn name(&self) -> &'static str {
        "kv-put"
    }

    fn cpu_fwd(&self, d: &mut CpuStorage, dl: &Layout, s: &CpuStorage, sl: &Layout) -> Result<()> {
        let (b, h, p, w) = dl.shape().dims4()?;
        let (sb, sh, t, sw) = sl.shape().dims4()?;
        let inside = self.positions.len() == t && self.positions.iter().all(|&at| at < p);
        if b != 1 || sb != 1 || sh != h || !inside || self.col + sw > w {
            return Err(Error::Msg(format!(
                "kv-put: {:?} at positions {:?} column {} does not fit {:?}",
                sl.dims(),
                self.positions.first()..self.positions.last(),
                self.col,
                dl.dims()
            )));
        }
        let (ss, o) = (sl.stride(), sl.start_offset());
        // Row (head i, token j) of src from `from`, to `to` in dst.
        let positions = self.positions;
        let rows =
            (0..h).flat_map(|i| positions.iter().enumerate().map(move |(j, &at)| (i, j, at)));
        let rows = rows.map(|(i, j, at)| {
            let from = o + i * ss[1] + j * ss[2];
            let to = dl.start_offset() + (i * p + at) * w + self.col;
            (from, to)
        });
        if ss[3] != 1 {
            return Err(Error::Msg("kv-put: rows with strided values".into()));
        }
        match (d, s) {
            (CpuStorage::F32(d), CpuStorage::F32(s)) => convert(d, s, rows, sw, |v| v),
            (CpuStorage::BF16(d), CpuStorage::BF16(s)) => convert(d, s, rows, sw, |v| v),
            (CpuStorage::F16(d), CpuStorage::F16(s)) => convert(d, s, rows, sw, |v| v),
            (CpuStorage::BF16(d), CpuStorage::F32(s)) => convert(d, s, rows, sw, to_bf16),
            (CpuStorage::F16(d), CpuStorage::F32(s)) => convert(d, s, rows, sw, f16::from_f32),
            (CpuStorage::F32(d), CpuStorage::BF16(s)) => convert(d, s, rows, sw, bf16::to_f32),
            (CpuStorage::F32(d), CpuStorage::F16(s)) => convert(d, s, rows, sw, f16::to_f32),
            (d, s) => {
                return Err(Error::Msg(format!(
                    "kv-put: {:?} into {:?}",
                    s.dtype(),
                    d.dtype()
                )))
            }
        }
        Ok(())
    }
}

/// `d[to + c] = f(s[from + c])` for each row's `w` columns: a loop over slices, which the
/// compiler vectorizes.
fn convert<S: Copy, D>(
    d: &mut [D],
    s: &[S],
    rows: impl Iterator<Item = (usize, usize)>,
    w: usize,
    f: impl Fn(S) -> D,
) {
    for (from, to) in rows {
        (d[to..to + w].iter_mut().zip(&s[from..from + w])).for_each(|(o, v)| *o = f(*v));
    }
}

/// `bf16::from_f32` (what candle's `to_dtype` calls) without its branches: a NaN keeps its
/// high bits with the quiet bit set; any other value rounds to the nearest, ties to even (up
/// in magnitude when bit 15 is set and any bit below it or bit 16 is), to infinity past the
/// largest bf16.
#[inline(always)]
fn to_bf16(v: f32) -> bf16 {
    let x = v.to_bits();
    let nan = x & 0x7FFF_FFFF > 0x7F80_0000;
    let up = (x & 0x8000 != 0) & (x & 0x1_7FFF != 0);
    let rounded = ((x >> 16) + up as u32) as u16;
    bf16::from_bits(if nan {
        (x >> 16) as u16 | 0x0040
    } else {
        rounded
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// [`to_bf16`] equals half's `bf16::from_f32` bit for bit: every tie, NaN, infinity,
    /// subnormal and the largest values, and a sweep of bit patterns.
    #[test]
    fn to_bf16_equals_halfs_rounding() {
        let specials = [
            0x0000_0000u32,
            0x8000_0000,
            0x0000_8000,
            0x0001_8000,
            0x3F80_8000,
            0x3F81_8000,
            0x3F80_7FFF,
            0x7F7F_FFFF,
            0x7F7F_8000,
            0x7F80_0000,
            0xFF80_0000,
            0x7F80_0001,
            0x7FC0_0000,
            0xFFFF_FFFF,
            0x7FFF_8000,
            0x807F_8000,
            0x0080_0000,
        ];
        let sweep = (0..=u32::MAX)
            .step_by(65_521)
            .chain((0..1 << 17).map(|i| 0x3F7F_0000 + i));
        for x in specials.into_iter().chain(sweep) {
            let v = f32::from_bits(x);
            assert_eq!(
                to_bf16(v).to_bits(),
                bf16::from_f32(v).to_bits(),
                "{x:#010x}"
            );
        }
    }

    /// A write in place equals candle's `to_dtype` and `slice_set` of the same rows: from a
    /// transposed view (strided rows) and from contiguous rows, into every dtype pair taken,
    /// at a position and column inside a larger cache; the rest of the cache untouched.
    #[test]
    fn put_equals_candles_write() -> Result<()> {
        let dev = Device::Cpu;
        let pairs = [
            (DType::BF16, DType::F32),
            (DType::F32, DType::F32),
            (DType::F16, DType::F32),
            (DType::BF16, DType::BF16),
            (DType::F32, DType::BF16),
        ];
        for (cache, from) in pairs {
            // (1, T, H, W) transposed to (1, H, T, W): each row strided, as a step's keys.
            let tokens = Tensor::randn(0f32, 3.0, (1, 5, 3, 16), &dev)?.to_dtype(from)?;
            for src in [
                tokens.transpose(1, 2)?,
                tokens.transpose(1, 2)?.contiguous()?,
            ] {
                let ours = Tensor::ones((1, 3, 40, 24), cache, &dev)?;
                let theirs = ours.copy()?;
                put(&ours, &src, &[7, 8, 9, 10, 11], 8).expect("taken")?;
                let wide = Tensor::cat(
                    &[
                        theirs.narrow(2, 7, 5)?.narrow(3, 0, 8)?,
                        src.to_dtype(cache)?,
                    ],
                    3,
                )?;
                theirs.slice_set(&wide.contiguous()?, 2, 7)?;
                let (a, b) = (ours.to_dtype(DType::F32)?, theirs.to_dtype(DType::F32)?);
                let diff = (a - b)?.abs()?.sum_all()?.to_scalar::<f32>()?;
                assert_eq!(diff, 0.0, "{from:?} into {cache:?}");
            }
        }
        let cache = Tensor::zeros((1, 3, 8, 16), DType::BF16, &dev)?;
        let src = Tensor::zeros((1, 3, 2, 16), DType::F32, &dev)?;
        // Rows with strided values are left to candle's write.
        assert!(put(&cache, &src.transpose(2, 3)?, &[0, 1], 0).is_none());
        // A write past the cache's end is an error, not a panic.
        assert!(put(&cache, &src, &[7, 8], 0).expect("taken").is_err());
        Ok(())
    }
}
