//! `--dtype` and `--device`: what the user asked for, and `auto`, the checkpoint's own dtype
//! resolved against what this device runs well.

use crate::error::{Error, Result};
use candle_core::{DType, Device};

/// `--dtype`: the checkpoint's own dtype (`auto`, the default) or a fixed one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DTypeArg {
    #[default]
    Auto,
    Fixed(DType),
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
            other => Err(Error::Invalid(format!(
                "unknown --dtype {other:?} (auto, f32, f16, bf16)"
            ))),
        }
    }

    /// The dtype to run in. `auto` keeps the checkpoint's (`declared` by config.json, checked
    /// against `stored`, the dtype holding most of the safetensors' bytes: the bytes win
    /// when they disagree), except f16 on a CPU, which runs as f32: candle's CPU ops have no
    /// fast f16 path and our product kernels read f32 and bf16, while f16 → f32 is exact.
    pub fn resolve(self, declared: Option<DType>, stored: Option<DType>, dev: &Device) -> DType {
        match self {
            DTypeArg::Fixed(d) => d,
            DTypeArg::Auto => match stored.or(declared).unwrap_or(DType::F32) {
                DType::F16 if dev.is_cpu() => DType::F32,
                d => d,
            },
        }
    }
}

/// The name `--json` and `info` report for a dtype: `f32`, `bf16`, `f16`.
pub fn name(d: DType) -> &'static str {
    d.as_str()
}

/// Parses `--device`; `cuda` needs a build with `--features cuda`.
pub fn parse_device(s: &str) -> Result<Device> {
    match s {
        "cpu" => Ok(Device::Cpu),
        "cuda" if !candle_core::utils::cuda_is_available() => Err(Error::Invalid(
            "--device cuda: this build has no CUDA support (rebuild with --features cuda)".into(),
        )),
        "cuda" => Ok(Device::new_cuda(0)?),
        other => Err(Error::Invalid(format!(
            "unknown --device {other:?} (cpu, cuda)"
        ))),
    }
}
