//! What a checkpoint's safetensors headers say, read without touching the weights: each
//! tensor's name, dtype and shape. `info` counts parameters from them, `--dtype auto` takes
//! the checkpoint's dtype from them, and quantized or exotic checkpoints are refused from
//! them before any tensor is read.

use crate::error::{Error, Result};
use candle_core::quantized::GgmlDType;
use candle_core::DType;
use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

/// A header longer than this is not a real one (the largest hub checkpoints' headers are a
/// few MB); refusing it keeps a corrupt length from becoming a huge allocation.
const MAX_HEADER: u64 = 100 << 20;

/// One tensor as its header describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// The safetensors dtype string: `F32`, `BF16`, `F8_E4M3`, `I32`, ...
    pub dtype: String,
    pub shape: Vec<usize>,
}

impl TensorInfo {
    pub fn elem_count(&self) -> usize {
        self.shape.iter().product()
    }

    /// The candle dtype of a floating-point tensor the engine runs (F32, F16, BF16).
    pub fn float_dtype(&self) -> Option<DType> {
        match self.dtype.as_str() {
            "F32" => Some(DType::F32),
            "F16" => Some(DType::F16),
            "BF16" => Some(DType::BF16),
            _ => None,
        }
    }
}

#[derive(serde::Deserialize)]
struct RawInfo {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: [u64; 2],
}

/// Bytes per element of a safetensors dtype; `None` for one we do not know (sub-byte or
/// new types), whose byte range is then only checked to lie in the data.
fn dtype_bytes(dtype: &str) -> Option<u64> {
    match dtype {
        "BOOL" | "U8" | "I8" | "F8_E4M3" | "F8_E5M2" | "F8_E8M0" => Some(1),
        "U16" | "I16" | "F16" | "BF16" => Some(2),
        "U32" | "I32" | "F32" => Some(4),
        "U64" | "I64" | "F64" => Some(8),
        _ => None,
    }
}

/// The tensor's shape and byte range agree with each other and with the `data` bytes the
/// file holds after its header, by checked arithmetic.
fn check_sizes(name: &str, raw: &RawInfo, data: u64) -> std::result::Result<(), String> {
    let count = raw
        .shape
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d as u64));
    let [begin, end] = raw.data_offsets;
    if begin > end || end > data {
        return Err(format!(
            "tensor {name}: bytes {begin}..{end} are not inside the {data} bytes of data"
        ));
    }
    match (count, dtype_bytes(&raw.dtype)) {
        (None, _) => Err(format!("tensor {name}: shape {:?} is too large", raw.shape)),
        (Some(n), Some(b)) if n.checked_mul(b) != Some(end - begin) => Err(format!(
            "tensor {name}: shape {:?} of {} needs {} bytes, its range holds {}",
            raw.shape,
            raw.dtype,
            n.saturating_mul(b),
            end - begin
        )),
        _ => Ok(()),
    }
}

/// Parses a header's JSON (the bytes after the 8-byte length), followed by `data` bytes.
fn parse(json: &[u8], data: u64, what: &Path) -> Result<Vec<TensorInfo>> {
    let map: BTreeMap<String, serde_json::Value> = serde_json::from_slice(json)
        .map_err(|e| Error::file(what, format!("not a safetensors file: bad header: {e}")))?;
    map.into_iter()
        .filter(|(name, _)| name != "__metadata__")
        .map(|(name, v)| {
            let raw: RawInfo = serde_json::from_value(v)
                .map_err(|e| Error::file(what, format!("bad header entry for {name}: {e}")))?;
            check_sizes(&name, &raw, data).map_err(|e| Error::file(what, e))?;
            Ok(TensorInfo {
                name,
                dtype: raw.dtype,
                shape: raw.shape,
            })
        })
        .collect()
}

/// The tensors of one safetensors file, from its header only.
pub fn read_file(path: &Path) -> Result<Vec<TensorInfo>> {
    let mut f = std::fs::File::open(path).map_err(|e| Error::file(path, e))?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .map_err(|_| Error::file(path, "not a safetensors file: shorter than its header"))?;
    let n = u64::from_le_bytes(len);
    let size = f.metadata().map_err(|e| Error::file(path, e))?.len();
    if n > MAX_HEADER || n.saturating_add(8) > size {
        return Err(Error::file(
            path,
            format!(
                "not a safetensors file: header length {n} does not fit the file ({size} bytes)"
            ),
        ));
    }
    let mut json = vec![0u8; n as usize];
    f.read_exact(&mut json).map_err(|e| Error::file(path, e))?;
    parse(&json, size - 8 - n, path)
}

/// The tensors of a safetensors file held in memory (a bundled model).
pub fn read_bytes(bytes: &[u8], what: &Path) -> Result<Vec<TensorInfo>> {
    let bad = || Error::file(what, "not a safetensors file: truncated header");
    let len: [u8; 8] = bytes
        .get(..8)
        .ok_or_else(bad)?
        .try_into()
        .map_err(|_| bad())?;
    let n = usize::try_from(u64::from_le_bytes(len)).map_err(|_| bad())?;
    let json = bytes.get(8..8usize.saturating_add(n)).ok_or_else(bad)?;
    parse(json, (bytes.len() - 8 - n) as u64, what)
}

/// The tensors of every file of a checkpoint, refusing quantized ones (see
/// [`refuse_quantized`]) with the file's name.
pub fn read_checked(paths: &[impl AsRef<Path>]) -> Result<Vec<TensorInfo>> {
    let mut all = Vec::new();
    for p in paths {
        let in_file = read_file(p.as_ref())?;
        refuse_quantized(&in_file, &p.as_ref().display().to_string())?;
        all.extend(in_file);
    }
    Ok(all)
}

/// Parameters the model takes from these tensors: every element once, except buffers
/// transformers never loads (`rotary_emb.inv_freq`) and a tied LM head stored beside the
/// embedding it repeats.
pub fn count_parameters(tensors: &[TensorInfo], tied: bool) -> usize {
    tensors
        .iter()
        .filter(|t| !t.name.ends_with("inv_freq"))
        .filter(|t| !(tied && t.name == "lm_head.weight"))
        .map(TensorInfo::elem_count)
        .sum()
}

/// Bytes that quantizing to `q` saves against `dtype`, by the rule
/// `Transformer::new_quantized` applies with `--dtype q8_0|q4_0`: every 2-D `*_proj.weight`
/// (and MLA's `kv_a_proj_with_mqa.weight`) under `model.layers` whose rows are whole blocks,
/// except MLA's `kv_b_proj` (its halves are multiplied per head), goes to `q`; the LM head
/// goes to Q8_0, and a tied one is an added Q8_0 copy of the embedding (so a small model can
/// come out negative). (transformers' fused expert tensors, 3-D here, are not counted.)
pub fn quantization_saved_bytes(
    tensors: &[TensorInfo],
    dtype: DType,
    q: GgmlDType,
    tied: bool,
) -> isize {
    let blocks = |t: &TensorInfo, q: GgmlDType| {
        t.shape.len() == 2 && t.shape[1].is_multiple_of(q.block_size())
    };
    let saved = |t: &TensorInfo, q: GgmlDType| {
        (t.elem_count() * dtype.size_in_bytes()) as isize
            - super::dtype::quantized_bytes(q, t.elem_count()) as isize
    };
    let projections: isize = tensors
        .iter()
        .filter(|t| t.name.starts_with("model.layers."))
        .filter(|t| t.name.ends_with("_proj.weight") || t.name.ends_with("_proj_with_mqa.weight"))
        .filter(|t| !t.name.ends_with("kv_b_proj.weight"))
        .filter(|t| blocks(t, q))
        .map(|t| saved(t, q))
        .sum();
    let head_name = if tied {
        "model.embed_tokens.weight"
    } else {
        "lm_head.weight"
    };
    let head = tensors
        .iter()
        .find(|t| t.name == head_name)
        .filter(|t| blocks(t, GgmlDType::Q8_0))
        .map_or(0, |t| match tied {
            true => -(super::dtype::quantized_bytes(GgmlDType::Q8_0, t.elem_count()) as isize),
            false => saved(t, GgmlDType::Q8_0),
        });
    projections + head
}

/// The floating-point dtype holding most of the checkpoint's bytes, if any.
pub fn main_float_dtype(tensors: &[TensorInfo]) -> Option<DType> {
    let mut bytes: BTreeMap<&'static str, (DType, usize)> = BTreeMap::new();
    for t in tensors {
        if let Some(d) = t.float_dtype() {
            let e = bytes.entry(d.as_str()).or_insert((d, 0));
            e.1 += t.elem_count() * d.size_in_bytes();
        }
    }
    bytes.into_values().max_by_key(|&(_, b)| b).map(|(d, _)| d)
}

/// Refuses a quantized or otherwise exotic checkpoint by its tensors: packed GPTQ/AWQ/
/// bitsandbytes tensors, or integer and 8-bit float weights, which the engine would
/// otherwise read as numbers they are not.
pub fn refuse_quantized(tensors: &[TensorInfo], source: &str) -> Result<()> {
    const PACKED: [(&str, &str); 7] = [
        ("qweight", "GPTQ/AWQ"),
        ("qzeros", "GPTQ/AWQ"),
        (".scales", "GPTQ/AWQ"),
        ("g_idx", "GPTQ"),
        ("weight.absmax", "bitsandbytes"),
        ("weight.quant_map", "bitsandbytes"),
        ("weight_scale_inv", "FP8"),
    ];
    for t in tensors {
        if let Some((_, method)) = PACKED.iter().find(|(s, _)| t.name.ends_with(s)) {
            return Err(Error::Weights(format!(
                "{source}: tensor {} is packed {method} quantized data, which this engine does \
                 not read: use the unquantized (bf16/f16/f32) checkpoint it was made from",
                t.name
            )));
        }
        // Only weights: an unused integer buffer (a position table) is harmless.
        let weight = t.name.ends_with(".weight") || t.name.ends_with(".bias");
        if weight && t.float_dtype().is_none() {
            let kind = match t.dtype.starts_with("F8") {
                true => "an 8-bit float (FP8-quantized)",
                false => "not a floating-point",
            };
            return Err(Error::Weights(format!(
                "{source}: tensor {} has dtype {}, {kind} type this engine does not run: use \
                 the unquantized (bf16/f16/f32) checkpoint it was made from",
                t.name, t.dtype
            )));
        }
    }
    Ok(())
}
