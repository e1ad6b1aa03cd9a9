//! Reading a CPU custom op's operands: the f32 values a contiguous layout covers, or an
//! error naming the op and operand (the row ops of `norm`, `rope`, `swiglu` and
//! `attention::prompt` share it).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Error, Layout, Result};

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
