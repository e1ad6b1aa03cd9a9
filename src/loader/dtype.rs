//! `--dtype` and `--device`: what the user asked for, and `auto`, the checkpoint's own dtype
//! resolved against what this device runs well.

use crate::error::{candle_message, Error, Result};
use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device};

/// `--dtype`: the checkpoint's own dtype (`auto`, the default), a fixed one, or the layers'
/// projections quantized at load to a ggml block format (the rest as with `auto`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DTypeArg {
    #[default]
    Auto,
    Fixed(DType),
    Quantized(GgmlDType),
}

impl From<DType> for DTypeArg {
    fn from(d: DType) -> Self {
        DTypeArg::Fixed(d)
    }
}

impl DTypeArg {
    /// Parses `--dtype`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(DTypeArg::Auto),
            "f32" | "float32" => Ok(DType::F32.into()),
            "f16" | "float16" => Ok(DType::F16.into()),
            "bf16" | "bfloat16" => Ok(DType::BF16.into()),
            "q8_0" => Ok(DTypeArg::Quantized(GgmlDType::Q8_0)),
            "q4_0" => Ok(DTypeArg::Quantized(GgmlDType::Q4_0)),
            other => Err(Error::Invalid(format!(
                "unknown --dtype {other:?} (auto, f32, f16, bf16, q8_0, q4_0)"
            ))),
        }
    }

    /// The block format the layers' projections are quantized to, if any.
    pub fn quantization(self) -> Option<GgmlDType> {
        match self {
            DTypeArg::Quantized(q) => Some(q),
            _ => None,
        }
    }

    /// The dtype to run in. `auto` keeps the checkpoint's (`declared` by config.json, checked
    /// against `stored`, the dtype holding most of the safetensors' bytes: the bytes win
    /// when they disagree), except f16 on a CPU, which runs as f32: candle's CPU ops have no
    /// fast f16 path and our product kernels read f32 and bf16, while f16 → f32 is exact.
    pub fn resolve(self, declared: Option<DType>, stored: Option<DType>, dev: &Device) -> DType {
        match self {
            DTypeArg::Fixed(d) => d,
            DTypeArg::Auto | DTypeArg::Quantized(_) => {
                match stored.or(declared).unwrap_or(DType::F32) {
                    DType::F16 if dev.is_cpu() => DType::F32,
                    d => d,
                }
            }
        }
    }
}

/// The name `--json` and `info` report for a dtype: `f32`, `bf16`, `f16`.
pub fn name(d: DType) -> &'static str {
    d.as_str()
}

/// The name reported for a model's weights: the block format of its projections when
/// quantized (`q8_0`, `q4_0`, a GGUF file's `q4_1`, `q4_k`...), as llama.cpp names them,
/// else its dtype's [`name`].
pub fn label(d: DType, quant: Option<GgmlDType>) -> &'static str {
    match quant {
        Some(GgmlDType::Q8_0) => "q8_0",
        Some(GgmlDType::Q4_0) => "q4_0",
        Some(GgmlDType::Q4_1) => "q4_1",
        Some(GgmlDType::Q5_0) => "q5_0",
        Some(GgmlDType::Q5_1) => "q5_1",
        Some(GgmlDType::Q2K) => "q2_k",
        Some(GgmlDType::Q3K) => "q3_k",
        Some(GgmlDType::Q4K) => "q4_k",
        Some(GgmlDType::Q5K) => "q5_k",
        Some(GgmlDType::Q6K) => "q6_k",
        Some(GgmlDType::Q8K) => "q8_k",
        Some(GgmlDType::Q8_1) => "q8_1",
        Some(GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16) | None => name(d),
    }
}

/// Bytes a row-major (rows, cols) matrix takes in block format `q`.
pub fn quantized_bytes(q: GgmlDType, elems: usize) -> usize {
    elems / q.block_size() * q.type_size()
}

/// Parses `--device`; `cuda` needs a build with `--features cuda`.
pub fn parse_device(s: &str) -> Result<Device> {
    match s {
        "cpu" => Ok(Device::Cpu),
        "cuda" if !candle_core::utils::cuda_is_available() => Err(Error::Invalid(
            "--device cuda: this build has no CUDA support (rebuild with --features cuda)".into(),
        )),
        "cuda" => Device::new_cuda(0).map_err(|e| {
            Error::Invalid(format!(
                "--device cuda: no usable CUDA device 0 ({}); use --device cpu",
                candle_message(&e)
            ))
        }),
        other => Err(Error::Invalid(format!(
            "unknown --device {other:?} (cpu, cuda)"
        ))),
    }
}
