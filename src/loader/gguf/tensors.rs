//! A GGUF file's tensors under the Hugging Face names the model asks for
//! (`model.layers.3.self_attn.q_proj.weight` is llama.cpp's `blk.3.attn_q.weight`), read one at
//! a time when the model is built, and with llama.cpp's Q/K row order undone for the Llama
//! architecture: dequantized to f32 for the `VarBuilder` (embeddings, norms, and every
//! weight with `--dtype f32|bf16|q8_0|q4_0`), and as the file's own blocks for the
//! projections and the LM head with `--dtype auto` (the [`Quantizer`] impl).

use crate::model::linear::{Blocks, Quantizer, StoredBlocks};
use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use std::path::PathBuf;
use std::sync::Arc;

/// Per-layer tensors: Hugging Face module path, llama.cpp name.
const LAYER: [(&str, &str); 9] = [
    ("input_layernorm", "attn_norm"),
    ("post_attention_layernorm", "ffn_norm"),
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
];

/// Tensors outside the layers: Hugging Face name, llama.cpp name.
const GLOBAL: [(&str, &str); 3] = [
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
];

/// llama.cpp's name for a Hugging Face tensor name, if it has one.
pub fn gguf_name(hf: &str) -> Option<String> {
    if let Some((_, g)) = GLOBAL.iter().find(|(h, _)| *h == hf) {
        return Some(g.to_string());
    }
    let (layer, rest) = hf.strip_prefix("model.layers.")?.split_once('.')?;
    layer.parse::<usize>().ok()?;
    let (module, param) = rest.rsplit_once('.')?;
    let (_, g) = LAYER.iter().find(|(h, _)| *h == module)?;
    Some(format!("blk.{layer}.{g}.{param}"))
}

/// The Hugging Face name of a llama.cpp tensor name, if it has one (the inverse of
/// [`gguf_name`]).
pub fn hf_name(gguf: &str) -> Option<String> {
    if let Some((h, _)) = GLOBAL.iter().find(|(_, g)| *g == gguf) {
        return Some(h.to_string());
    }
    let (layer, rest) = gguf.strip_prefix("blk.")?.split_once('.')?;
    layer.parse::<usize>().ok()?;
    let (module, param) = rest.rsplit_once('.')?;
    let (h, _) = LAYER.iter().find(|(_, g)| *g == module)?;
    Some(format!("model.layers.{layer}.{h}.{param}"))
}

/// Undoes llama.cpp's row order for q_proj/k_proj (weight or bias): its converter
/// interleaves each head's rotary halves into pairs, (heads, 2, half) → (heads, half, 2) on
/// the rows, for its interleaved RoPE; this swaps them back, as transformers'
/// `LlamaTensorProcessor._reverse_permute_weights` does.
pub(super) fn unpermute(w: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let dims = w.dims().to_vec();
    let rows = dims.first().copied().unwrap_or(0);
    if heads == 0 || rows % (2 * heads) != 0 {
        candle_core::bail!("{rows} rows do not split into {heads} heads of rotary pairs");
    }
    let mut split = vec![heads, rows / heads / 2, 2];
    split.extend_from_slice(&dims[1..]);
    // (H, half, 2, in) -> (H, 2, half, in)
    w.reshape(split)?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)
}

/// [`unpermute`] for the bytes of a matrix of shape `dims` in any block format: its rows
/// are whole blocks, moved as bytes.
fn unpermute_blocks(data: &[u8], dims: &[usize], heads: usize) -> candle_core::Result<Vec<u8>> {
    let &[rows, _] = dims else {
        candle_core::bail!("shape {dims:?} is not a matrix");
    };
    if heads == 0 || rows == 0 || !rows.is_multiple_of(2 * heads) {
        candle_core::bail!("{rows} rows do not split into {heads} heads of rotary pairs");
    }
    let (row, half) = (data.len() / rows, rows / heads / 2);
    let mut out = Vec::with_capacity(data.len());
    for h in 0..heads {
        for pair in 0..2 {
            for j in 0..half {
                let r = (h * half + j) * 2 + pair;
                out.extend_from_slice(&data[r * row..(r + 1) * row]);
            }
        }
    }
    Ok(out)
}

/// Whether `q` is one of ggml's block formats (not a plain float type).
pub fn is_blocks(q: GgmlDType) -> bool {
    !matches!(q, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16)
}

/// The open file as a `VarBuilder` backend: each tensor is read from disk when the model asks
/// for it, so the resident peak is the built model plus one tensor.
#[derive(Clone)]
pub(super) struct GgufTensors {
    pub path: PathBuf,
    pub content: Arc<Content>,
    /// Llama only: the head counts that q_proj and k_proj rows are grouped by.
    pub permute: Option<(usize, usize)>,
    /// The model is built with this same file as its [`Quantizer`] (`--dtype auto`): the
    /// weights it will take as blocks are not dequantized first ([`Self::deferred`]).
    pub defer_blocks: bool,
}

impl GgufTensors {
    /// llama.cpp's name for `hf` and the head count its rows are permuted by, if any.
    fn find(&self, hf: &str) -> Option<(String, Option<usize>)> {
        let name = gguf_name(hf).filter(|g| self.content.tensor_infos.contains_key(g))?;
        let heads = match (
            self.permute,
            name.contains(".attn_q."),
            name.contains(".attn_k."),
        ) {
            (Some((heads, _)), true, _) => Some(heads),
            (Some((_, kv_heads)), _, true) => Some(kv_heads),
            _ => None,
        };
        Some((name, heads))
    }

    /// The bytes of the tensor `gguf` as the file stores them, read once (the reader checked
    /// at open that they lie inside the file).
    fn stored(&self, gguf: &str) -> candle_core::Result<StoredBlocks> {
        use std::io::{Read, Seek, SeekFrom};
        let info = &self.content.tensor_infos[gguf];
        let size = super::reader::byte_size(info).unwrap_or_default();
        let mut file = std::fs::File::open(&self.path)?;
        file.seek(SeekFrom::Start(
            self.content.tensor_data_offset + info.offset,
        ))?;
        let mut bytes = vec![0u8; size as usize];
        file.read_exact(&mut bytes)?;
        Ok(StoredBlocks {
            dtype: info.ggml_dtype,
            dims: info.shape.dims().to_vec(),
            bytes,
        })
    }

    /// The block format holding most of the bytes of the tensors kept in blocks (the
    /// projections and the LM head), if any is.
    pub fn main_block_format(&self) -> Option<GgmlDType> {
        let mut bytes: Vec<(GgmlDType, usize)> = Vec::new();
        for (name, t) in &self.content.tensor_infos {
            let taken = hf_name(name).is_some_and(|h| keeps_blocks(&h));
            if taken && is_blocks(t.ggml_dtype) {
                // Every size fits: the reader checked them at open.
                let n = super::reader::byte_size(t).unwrap_or_default() as usize;
                match bytes.iter_mut().find(|(q, _)| *q == t.ggml_dtype) {
                    Some(e) => e.1 += n,
                    None => bytes.push((t.ggml_dtype, n)),
                }
            }
        }
        bytes.into_iter().max_by_key(|&(_, n)| n).map(|(q, _)| q)
    }

    /// A stand-in of shape `s` for `hf`, allocating nothing (one value, broadcast), when
    /// the model takes `hf` as the file's blocks right after building its layer
    /// ([`Linear::quantize`](crate::model::linear::Linear::quantize) replaces every such
    /// weight: [`Quantizer::blocks`] gives it blocks of its shape in whole rows of
    /// blocks). A layer is then never dense at load, and the peak stays near the file's
    /// size. The embedding is always read: it is dense off the CPU.
    fn deferred(&self, hf: &str, s: &Shape, dtype: DType, dev: &Device) -> Option<Tensor> {
        let layer = hf.starts_with("model.layers.") && hf.ends_with("_proj.weight");
        if !self.defer_blocks || !(layer || hf == "lm_head.weight") {
            return None;
        }
        let (name, _) = self.find(hf)?;
        let info = &self.content.tensor_infos[&name];
        let whole = info.shape.dims() == s.dims()
            && s.rank() == 2
            && s.dims()[1].is_multiple_of(info.ggml_dtype.block_size());
        if !is_blocks(info.ggml_dtype) || !whole {
            return None;
        }
        Tensor::zeros((), dtype, dev)
            .and_then(|t| t.broadcast_as(s))
            .ok()
    }

    /// The tensor named `hf` (a Hugging Face name), dequantized to f32 on `dev`.
    pub fn read(&self, hf: &str, dev: &Device) -> candle_core::Result<Tensor> {
        let Some((name, heads)) = self.find(hf) else {
            return Err(candle_core::Error::CannotFindTensor { path: hf.into() });
        };
        let mut file = std::fs::File::open(&self.path)?;
        let t = self
            .content
            .tensor(&mut file, &name, dev)?
            .dequantize(dev)?;
        match heads {
            Some(heads) => unpermute(&t, heads),
            None => Ok(t),
        }
        .map_err(|e| e.context(format!("tensor {name}")))
    }
}

/// Whether the model takes the tensor `hf` (a Hugging Face name) as blocks when the file
/// stores it so: a layer's projection, or the LM head (the embedding, for a tied one).
pub fn keeps_blocks(hf: &str) -> bool {
    crate::model::linear::is_head(hf)
        || (hf.starts_with("model.layers.") && hf.ends_with("_proj.weight"))
}

/// `--dtype auto`: the file's own blocks for each projection and the LM head that it stores
/// in a block format (read again as stored, never dequantized); float tensors stay dense.
impl Quantizer for GgufTensors {
    fn blocks(&self, name: Option<&str>) -> candle_core::Result<Option<Blocks>> {
        let Some((gguf, heads)) = name.filter(|n| keeps_blocks(n)).and_then(|n| self.find(n))
        else {
            return Ok(None);
        };
        if !is_blocks(self.content.tensor_infos[&gguf].ggml_dtype) {
            return Ok(None);
        }
        let named = |e: candle_core::Error| e.context(format!("tensor {gguf}"));
        let mut t = self.stored(&gguf).map_err(named)?;
        if let Some(heads) = heads {
            t.bytes = unpermute_blocks(&t.bytes, &t.dims, heads).map_err(named)?;
        }
        Ok(Some(Blocks::Stored(t)))
    }

    fn label(&self) -> GgmlDType {
        self.main_block_format().unwrap_or(GgmlDType::F32)
    }
}

impl SimpleBackend for GgufTensors {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        if let Some(t) = self.deferred(name, &s, dtype, dev) {
            return Ok(t);
        }
        let t = self.read(name, dev)?;
        if t.shape() != &s {
            return Err(candle_core::Error::UnexpectedShape {
                msg: format!("shape mismatch for {name}"),
                expected: s,
                got: t.shape().clone(),
            });
        }
        t.to_dtype(dtype)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.read(name, dev)?.to_dtype(dtype)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        gguf_name(name).is_some_and(|g| self.content.tensor_infos.contains_key(&g))
    }
}

#[cfg(test)]
mod tests {
    use super::unpermute_blocks;

    /// Rows of bytes come back in transformers' order; a shape from a hostile file that is
    /// not a matrix of whole head pairs is an error, not a panic.
    #[test]
    fn block_rows_are_unpermuted_as_bytes_and_bad_shapes_refused() {
        // 4 rows of 2 bytes, 1 head: rows (0, 1, 2, 3) interleaved as pairs -> (0, 2, 1, 3).
        let data = [0, 0, 1, 1, 2, 2, 3, 3];
        let out = unpermute_blocks(&data, &[4, 64], 1).unwrap();
        assert_eq!(out, [0, 0, 2, 2, 1, 1, 3, 3]);
        for dims in [&[][..], &[4], &[0, 64], &[3, 64], &[4, 64, 1]] {
            assert!(unpermute_blocks(&data, dims, 1).is_err(), "{dims:?}");
        }
        assert!(unpermute_blocks(&data, &[4, 64], 0).is_err());
    }
}
