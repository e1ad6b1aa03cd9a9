//! The one door by which block formats enter the model ([`Quantizer`]): for each projection,
//! the blocks that replace its dense weight, made at load (`--dtype q8_0|q4_0`) or read from
//! a file (a GGUF's).

use super::quant::{Format, QWeight};
use super::Linear;
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{Device, Result};
use std::borrow::Cow;
use std::sync::Arc;

/// How a projection is stored in blocks: quantized from its dense weight as it loads
/// (`--dtype q8_0|q4_0`), or the blocks a file already holds (a GGUF's).
pub enum Blocks {
    Made(GgmlDType),
    Stored(StoredBlocks),
}

/// A weight's blocks as a file stores them: ggml's bytes of a `dims` tensor in `dtype`, read
/// once (candle's reader holds them twice while it loads a tensor, and a `QTensor` beside
/// our packed copy would be a third).
pub struct StoredBlocks {
    pub dtype: GgmlDType,
    pub dims: Vec<usize>,
    pub bytes: Vec<u8>,
}

impl StoredBlocks {
    /// As our kernels' weight of `rows x cols` in `format` (this block format's ours).
    pub fn weight(&self, format: Format, (rows, cols): (usize, usize)) -> Result<QWeight> {
        QWeight::from_ggml(format, rows, cols, &self.bytes).ok_or_else(|| {
            candle_core::Error::Msg(format!("cannot read stored blocks as {:?}", self.dtype))
        })
    }

    /// As candle's quantized tensor on `dev` (where our kernels do not run them).
    pub fn into_qtensor(self, dev: &Device) -> Result<QTensor> {
        let storage = QStorage::from_data(Cow::Owned(self.bytes), dev, self.dtype)?;
        QTensor::new(storage, self.dims)
    }
}

/// The one door by which block formats enter the model: for each projection the model loads
/// (by its checkpoint name, when it has one), which blocks replace its dense weight.
pub trait Quantizer {
    /// The blocks for the weight `name`, or `None` to keep it dense.
    fn blocks(&self, name: Option<&str>) -> Result<Option<Blocks>>;

    /// The format most of the projections end up in: what `--json` reports as `dtype`.
    fn label(&self) -> GgmlDType;
}

/// Whether `name` is the LM head's weight (or the embedding standing in for a tied one).
pub fn is_head(name: &str) -> bool {
    name == "lm_head.weight" || name == "model.embed_tokens.weight"
}

/// `--dtype q8_0|q4_0`: every projection quantized to this format as it loads, and the LM
/// head to Q8_0 whatever it is (llama.cpp keeps the output matrix at 6 bits or more: at
/// 4 bits it costs the most quality per byte saved).
impl Quantizer for GgmlDType {
    fn blocks(&self, name: Option<&str>) -> Result<Option<Blocks>> {
        Ok(Some(match name {
            Some(name) if is_head(name) => Blocks::Made(GgmlDType::Q8_0),
            _ => Blocks::Made(*self),
        }))
    }

    fn label(&self) -> GgmlDType {
        *self
    }
}

/// Quantizes each of `linears` whose rows are whole blocks; returns the bytes saved.
pub fn quantize_all(linears: &mut [&mut Linear], q: &dyn Quantizer) -> Result<usize> {
    let mut saved = 0;
    for l in linears.iter_mut() {
        let before = l.weight_bytes();
        if l.quantize(q)? {
            saved += before - l.weight_bytes();
        }
    }
    Ok(saved)
}

/// Our CPU kernels' name for one of ggml's block formats, if they run it.
pub fn our_format(q: GgmlDType) -> Option<Format> {
    Some(match q {
        GgmlDType::Q8_0 => Format::Q8_0,
        GgmlDType::Q4_0 => Format::Q4_0,
        GgmlDType::Q4_1 => Format::Q4_1,
        GgmlDType::Q5_0 => Format::Q5_0,
        GgmlDType::Q5_1 => Format::Q5_1,
        GgmlDType::Q2K => Format::Q2K,
        GgmlDType::Q3K => Format::Q3K,
        GgmlDType::Q4K => Format::Q4K,
        GgmlDType::Q5K => Format::Q5K,
        GgmlDType::Q6K => Format::Q6K,
        _ => return None,
    })
}

/// A file's stored blocks (a GGUF's, read on CPU) as our kernels' weight, when they run
/// its format.
pub fn stored_weight(t: &StoredBlocks) -> Result<Option<Arc<QWeight>>> {
    let (Some(format), &[rows, cols]) = (our_format(t.dtype), t.dims.as_slice()) else {
        return Ok(None);
    };
    Ok(Some(Arc::new(t.weight(format, (rows, cols))?)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Tensor};

    /// Keeps every weight dense.
    struct Nothing;

    impl Quantizer for Nothing {
        fn blocks(&self, _: Option<&str>) -> Result<Option<Blocks>> {
            Ok(None)
        }

        fn label(&self) -> GgmlDType {
            GgmlDType::F32
        }
    }

    #[test]
    fn a_stand_in_for_blocks_is_never_kept() {
        let stand_in = Tensor::zeros((), DType::F32, &Device::Cpu)
            .and_then(|t| t.broadcast_as((4, 32)))
            .unwrap();
        let mut l = Linear::new(stand_in, None).named("model.layers.0.mlp.up_proj.weight");
        let e = l.quantize(&Nothing).unwrap_err().to_string();
        assert!(
            e.contains("up_proj.weight") && e.contains("not taken"),
            "{e}"
        );
        // A real dense weight the quantizer leaves is kept as it is.
        let dense = Tensor::ones((4, 32), DType::F32, &Device::Cpu).unwrap();
        assert!(!Linear::new(dense, None).quantize(&Nothing).unwrap());
    }
}
