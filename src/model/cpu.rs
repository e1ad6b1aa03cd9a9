//! Reading a CPU custom op's operands: the f32 values a contiguous layout covers, or an
//! error naming the op and operand (the row ops of `norm`, `rope`, `swiglu` and
//! `attention::prompt` share it), and [`cat_rows`], a concatenation of views.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Error, Layout, Result, Storage, Tensor, WithDType};

/// The f32 values `l` covers in `s`, contiguous; else an error naming `what`.
pub fn f32_rows<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    let CpuStorage::F32(v) = s else {
        return Err(Error::Msg(format!("{what}: f32 only, got {:?}", s.dtype())));
    };
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(&v[start..end]),
        None => Err(Error::Msg(format!("{what} must be contiguous"))),
    }
}

/// `Tensor::cat` of rank-4 tensors along their last dimension into a new contiguous tensor,
/// for f32 or bf16 on the CPU whatever the parts' layouts (transposed views, a part broadcast
/// along a dimension), as long as each part's rows are contiguous; `None` otherwise
/// (candle's cat).
///
/// Why: candle concatenates views through its general strided copy, one element at a time,
/// where here each row of each part is one `copy_from_slice`. MLA's prompts build each
/// head's query and key this way (`[q_nope | q_pe]`, `[C·W_UKᵀ | k_pe]` with `k_pe` shared by
/// the heads): candle's cats were 9% of `mla:192,rope=64`'s 512-token prefill (Zen 5).
pub fn cat_rows(parts: &[&Tensor]) -> Option<Result<Tensor>> {
    let first = parts.first()?;
    let dims = first.dims().get(..3)?.to_vec();
    let dtype = first.dtype();
    let ours = matches!(dtype, DType::F32 | DType::BF16)
        && parts.iter().all(|t| {
            t.device().is_cpu()
                && t.dtype() == dtype
                && t.rank() == 4
                && t.dims()[..3] == dims[..]
                && (t.stride()[3] == 1 || t.dims()[3] <= 1)
        });
    ours.then(|| match dtype {
        DType::BF16 => cat_rows_of::<half::bf16>(parts, &dims),
        _ => cat_rows_of::<f32>(parts, &dims),
    })
}

/// [`cat_rows`] of parts of `T`, their first three dimensions `dims`.
fn cat_rows_of<T: WithDType>(parts: &[&Tensor], dims: &[usize]) -> Result<Tensor> {
    {
        let widths: Vec<usize> = parts.iter().map(|t| t.dims()[3]).collect();
        let width: usize = widths.iter().sum();
        let rows = dims.iter().product::<usize>();
        let mut out = vec![T::zero(); rows * width];
        // out (D0, D1, D2, width): row (i, j, k) holds each part's row (i, j, k) in turn,
        // part p from column `at` (the widths before it).
        let mut at = 0;
        for (part, w) in parts.iter().zip(&widths) {
            if *w == 0 {
                continue; // nothing to read (its strides may point past its storage)
            }
            let (storage, layout) = part.storage_and_layout();
            let Storage::Cpu(storage) = &*storage else {
                return Err(Error::Msg("cat_rows: CPU parts only".into()));
            };
            let v = T::cpu_storage_as_slice(storage)?;
            let (s, o) = (layout.stride(), layout.start_offset());
            let mut row = 0;
            for i in 0..dims[0] {
                for j in 0..dims[1] {
                    for k in 0..dims[2] {
                        let from = o + i * s[0] + j * s[1] + k * s[2];
                        out[row * width + at..][..*w].copy_from_slice(&v[from..from + w]);
                        row += 1;
                    }
                }
            }
            at += w;
        }
        let shape = (dims[0], dims[1], dims[2], width);
        Tensor::from_vec(out, shape, parts[0].device())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, D};

    /// Views (a transposed one, one broadcast along the heads) concatenate as candle's cat
    /// does, into a contiguous tensor, in f32 and bf16; other dtypes are left to candle.
    #[test]
    fn cat_rows_equals_candles_cat_of_views() -> Result<()> {
        let dev = Device::Cpu;
        let a = Tensor::arange(0f32, 2. * 5. * 3. * 4., &dev)?
            .reshape((2, 5, 3, 4))?
            .transpose(1, 2)?; // (2, 3, 5, 4), rows contiguous
        let b = Tensor::arange(100f32, 110., &dev)?
            .reshape((2, 1, 5, 1))?
            .broadcast_as((2, 3, 5, 1))?;
        // Narrowed out of wider rows (a start offset), and a one-wide part whose last
        // stride is 5.
        let wide = Tensor::arange(200f32, 200. + 2. * 3. * 5. * 4., &dev)?.reshape((2, 3, 5, 4))?;
        let c = wide.narrow(3, 1, 2)?;
        let d = Tensor::arange(300f32, 330., &dev)?
            .reshape((2, 3, 1, 5))?
            .transpose(2, 3)?;
        assert_eq!(d.stride()[3], 5);
        let none = wide.narrow(3, 0, 0)?;
        let parts = [&a, &b, &c, &none, &d];
        let ours = cat_rows(&parts).expect("f32 on the CPU")?;
        let want = Tensor::cat(&parts, D::Minus1)?;
        assert!(ours.is_contiguous());
        assert_eq!(ours.dims(), want.dims());
        let diff = (ours - want)?.abs()?.sum_all()?.to_scalar::<f32>()?;
        assert_eq!(diff, 0.0);
        // bf16 alike; other dtypes are candle's.
        let bf: Vec<Tensor> = parts
            .iter()
            .map(|t| t.to_dtype(DType::BF16))
            .collect::<Result<_>>()?;
        let bf: Vec<&Tensor> = bf.iter().collect();
        let ours = cat_rows(&bf)
            .expect("bf16 on the CPU")?
            .to_dtype(DType::F32)?;
        let want = Tensor::cat(&bf, D::Minus1)?.to_dtype(DType::F32)?;
        assert_eq!((ours - want)?.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
        assert!(cat_rows(&[&a.to_dtype(DType::F16)?]).is_none());
        Ok(())
    }
}
