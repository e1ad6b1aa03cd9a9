//! The cache's dtype: chosen from the weights (`auto`), or asked for by `--kv-dtype`.

use crate::error::{Error, Result};
use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device};

/// The cache's dtype for weights in `weights`, in the block format `quantization` if any,
/// on `dev`: the weights' own, except block-quantized weights on CPU, whose f32 activations
/// are kept in bf16 (half f32's bytes, as llama.cpp's f16 cache by default): SmolLM2-135M's Q4_0 file,
/// Zen 5, decode after a 2000-token prompt 169-174 -> 207-219 tok/s, 8 sequences of
/// 32 + 256 tokens at once 854-858 -> 928-937 (`--kv-dtype f32` against bf16).
pub fn dtype_for(weights: DType, quantization: Option<GgmlDType>, dev: &Device) -> DType {
    use GgmlDType::{BF16, F16, F32};
    let blocks = quantization.is_some_and(|q| !matches!(q, F32 | F16 | BF16));
    match blocks && dev.is_cpu() && weights == DType::F32 {
        true => DType::BF16,
        false => weights,
    }
}

/// `--kv-dtype`: `None` for `auto` ([`dtype_for`]), else f32 or bf16; read before a model
/// loads, so a misspelt name costs no load.
pub fn parse_dtype(arg: &str) -> Result<Option<DType>> {
    match arg.trim().to_ascii_lowercase().as_str() {
        "auto" => Ok(None),
        "f32" => Ok(Some(DType::F32)),
        "bf16" => Ok(Some(DType::BF16)),
        other => Err(Error::Invalid(format!(
            "--kv-dtype {other}: expected auto, f32 or bf16"
        ))),
    }
}

/// The cache's dtype: `asked` (`None`: [`dtype_for`]) for weights in `weights` (blocks of
/// `quantization`) on `dev`. On CPU, where activations are f32 and the attention kernels read
/// either, f32 or bf16; elsewhere only the weights' dtype, which the activations are in.
pub fn choose_dtype(
    asked: Option<DType>,
    weights: DType,
    quantization: Option<GgmlDType>,
    dev: &Device,
) -> Result<DType> {
    match asked {
        None => Ok(dtype_for(weights, quantization, dev)),
        Some(d) if dev.is_cpu() || d == weights => Ok(d),
        Some(d) => Err(Error::Invalid(format!(
            "--kv-dtype {}: off the CPU the cache keeps the weights' dtype ({})",
            d.as_str(),
            weights.as_str()
        ))),
    }
}
