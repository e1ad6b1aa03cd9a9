//! The token embedding: candle_nn's dense table, or a GGUF file's own blocks, in which a
//! lookup dequantizes one row per token and a tied LM head multiplies by the same blocks
//! (so a GGUF model holds its largest matrix once, at the file's size, as llama.cpp does).

use super::linear::quant::QWeight;
use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::Embedding;
use std::sync::Arc;

#[derive(Debug, Clone)]
pub enum TokenEmbedding {
    Dense(Embedding),
    /// (vocab, hidden) in blocks, on CPU; rows come out as `dtype`.
    Blocks {
        table: Arc<QWeight>,
        dtype: DType,
    },
}

impl TokenEmbedding {
    /// (.., T) ids to (.., T, hidden). An id past the vocabulary is an error, not a panic.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let (table, dtype) = match self {
            TokenEmbedding::Dense(e) => return e.forward(ids),
            TokenEmbedding::Blocks { table, dtype } => (table, *dtype),
        };
        let (rows, cols) = (table.rows(), table.cols());
        let ids_v = ids.flatten_all()?.to_vec1::<u32>()?;
        let mut out = Vec::with_capacity(ids_v.len() * cols);
        let mut buf = Vec::new();
        for &id in &ids_v {
            if id as usize >= rows {
                return Err(candle_core::Error::Msg(format!(
                    "token id {id} is past the embedding's {rows} rows"
                )));
            }
            out.extend_from_slice(table.dequantize_transposed(
                (id as usize, 1),
                (0, cols),
                &mut buf,
            ));
        }
        let mut dims = ids.dims().to_vec();
        dims.push(cols);
        Tensor::from_vec(out, dims, &Device::Cpu)?.to_dtype(dtype)
    }

    /// The dense table, unless it is in blocks.
    pub fn table(&self) -> Option<&Tensor> {
        match self {
            TokenEmbedding::Dense(e) => Some(e.embeddings()),
            TokenEmbedding::Blocks { .. } => None,
        }
    }

    pub fn device(&self) -> Device {
        match self {
            TokenEmbedding::Dense(e) => e.embeddings().device().clone(),
            TokenEmbedding::Blocks { .. } => Device::Cpu,
        }
    }

    /// The dtype the model's weights (and cache) are held in.
    pub fn dtype(&self) -> DType {
        match self {
            TokenEmbedding::Dense(e) => e.embeddings().dtype(),
            TokenEmbedding::Blocks { dtype, .. } => *dtype,
        }
    }

    /// Bytes the table occupies.
    pub fn bytes(&self) -> usize {
        match self {
            TokenEmbedding::Dense(e) => {
                e.embeddings().elem_count() * e.embeddings().dtype().size_in_bytes()
            }
            TokenEmbedding::Blocks { table, .. } => table.bytes(),
        }
    }
}
