//! One entry of a GGUF tensor table, read and checked as `reader` reads the rest: its
//! dimensions (at most 4, each positive, their product in range), its ggml type (those
//! candle reads; the others refused by name) and its rows in whole blocks; and a tensor's
//! byte size by checked arithmetic.

use super::{Cursor, Parse};
use candle_core::quantized::gguf_file::TensorInfo;
use candle_core::quantized::GgmlDType;
use std::io::{Read, Seek};

/// GGML_MAX_DIMS.
const MAX_DIMS: usize = 4;

/// ggml's type ids for the types candle reads (candle's own table is private).
fn ggml_type(id: u32) -> Option<GgmlDType> {
    Some(match id {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        9 => GgmlDType::Q8_1,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        15 => GgmlDType::Q8K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

/// ggml's name for a type id we do not read (ggml.h's `ggml_type`), for the error.
fn type_name(id: u32) -> String {
    let name = match id {
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => return format!("{id}"),
    };
    format!("{name} ({id})")
}

pub(super) fn tensor_info<R: Read + Seek>(c: &mut Cursor<R>) -> Parse<TensorInfo> {
    let n_dims = c.u32()? as usize;
    if n_dims > MAX_DIMS {
        return Err(format!("{n_dims} dimensions, more than {MAX_DIMS}"));
    }
    let mut dims = Vec::with_capacity(n_dims);
    for _ in 0..n_dims {
        match c.u64()? {
            // llama.cpp allows 0; no weight is empty, and candle cannot read one.
            0 => return Err("a dimension is 0".into()),
            d if d > i64::MAX as u64 => return Err(format!("a dimension is {d}")),
            d => dims.push(d as usize),
        }
    }
    let id = c.u32()?;
    let ggml_dtype =
        ggml_type(id).ok_or_else(|| format!("type {} is not supported", type_name(id)))?;
    let offset = c.u64()?;
    let row = dims.first().copied().unwrap_or(1);
    if row % ggml_dtype.block_size() != 0 {
        return Err(format!(
            "its rows of {row} values are not whole {ggml_dtype:?} blocks of {}",
            ggml_dtype.block_size()
        ));
    }
    let count = dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    if count.is_none_or(|n| n > i64::MAX as usize) {
        return Err(format!("its shape {dims:?} has too many values"));
    }
    // GGUF lists the fastest dimension first; candle's shapes are row-major.
    dims.reverse();
    Ok(TensorInfo {
        ggml_dtype,
        shape: dims.into(),
        offset,
    })
}

/// Bytes of a tensor's data, by checked arithmetic (`None` only for a table not checked
/// here: every `Content` this module returns has sizes that fit).
pub(in crate::loader::gguf) fn byte_size(t: &TensorInfo) -> Option<u64> {
    let blocks = t
        .shape
        .dims()
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d as u64))?
        / t.ggml_dtype.block_size() as u64;
    blocks.checked_mul(t.ggml_dtype.type_size() as u64)
}
