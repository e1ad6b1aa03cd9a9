//! A GGUF file's tensors under the Hugging Face names the model asks for
//! (`model.layers.3.self_attn.q_proj.weight` is llama.cpp's `blk.3.attn_q.weight`), read one at
//! a time when the model is built, dequantized to f32, and with llama.cpp's Q/K row order
//! undone for the Llama architecture.
//!
//! Dequantized at load for now: the block formats (Q4_0, Q4_1, Q8_0, Q4_K, ...) are expanded
//! to f32 (then to the run dtype) here, so a Q4_1 file runs as fast and as large as its f32
//! directory. Keeping them in their blocks waits for the quantized `Linear`.

use candle_core::quantized::gguf_file::Content;
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

/// The open file as a `VarBuilder` backend: each tensor is read from disk when the model asks
/// for it, so the resident peak is the built model plus one tensor.
pub(super) struct GgufTensors {
    pub path: PathBuf,
    pub content: Arc<Content>,
    /// Llama only: the head counts that q_proj and k_proj rows are grouped by.
    pub permute: Option<(usize, usize)>,
}

impl GgufTensors {
    /// The tensor named `hf` (a Hugging Face name), dequantized to f32 on `dev`.
    pub fn read(&self, hf: &str, dev: &Device) -> candle_core::Result<Tensor> {
        let Some(name) = gguf_name(hf).filter(|g| self.content.tensor_infos.contains_key(g)) else {
            return Err(candle_core::Error::CannotFindTensor { path: hf.into() });
        };
        let mut file = std::fs::File::open(&self.path)?;
        let q = self.content.tensor(&mut file, &name, dev)?;
        let t = q.dequantize(dev)?;
        match (
            self.permute,
            name.contains(".attn_q."),
            name.contains(".attn_k."),
        ) {
            (Some((heads, _)), true, _) => unpermute(&t, heads),
            (Some((_, kv_heads)), _, true) => unpermute(&t, kv_heads),
            _ => Ok(t),
        }
        .map_err(|e| e.context(format!("tensor {name}")))
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
