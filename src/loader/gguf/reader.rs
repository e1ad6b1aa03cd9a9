//! A GGUF file's header (metadata and tensor table) read as strictly as llama.cpp's
//! `gguf.cpp` reads it, through a buffer, checking every count and size against the bytes
//! left in the file before anything is allocated from it. The result is candle's
//! [`Content`]: its tensor table locates every tensor for the rest of the loader, which reads
//! the blocks it keeps itself (`tensors`) and the rest through candle's reader.
//!
//! We do not use candle's `Content::read`: it divides by `general.alignment` unchecked (0
//! panics), multiplies dimensions unchecked, reads one syscall per value, and accepts tensor
//! data that overlaps, is misaligned, or is described with the wrong type, so a model runs on
//! misread bytes. Here, as in llama.cpp: version 2 or 3; keys and tensor names unique;
//! `general.alignment` a u32 power of two; at most 4 dimensions, each positive, their product
//! and byte size in range; each tensor's data starting where the previous one's padded data
//! ends, in declaration order, and inside the file. Arrays the loader never reads (all but
//! `tokenizer.ggml.*`) are skipped, not materialised, when they are large.
//!
//! One tensor's entry in the table (its dimensions, type and size) is read in `table` (`reader/table.rs`).

use crate::error::{Error, Result};
use candle_core::quantized::gguf_file::{Content, Value, VersionedMagic};
use std::collections::HashMap;
use std::io::{BufReader, Read, Seek};
use std::path::Path;

mod table;
pub(super) use table::byte_size;
use table::tensor_info;

/// A header that does not parse: what is wrong, for a message that names the file.
type Parse<T> = std::result::Result<T, String>;

/// GGML_MAX_NAME: a tensor name is shorter than this.
const MAX_NAME: usize = 64;
/// Longest key, and longest string value (a chat template is tens of kB).
const MAX_KEY: u64 = 1 << 16;
const MAX_STRING: u64 = 1 << 24;
/// Most elements of one `tokenizer.ggml.*` array (vocabularies are under 300k tokens).
const MAX_VOCAB_ARRAY: u64 = 1 << 21;
/// Larger arrays under other keys are skipped: the loader never reads them.
const MAX_OTHER_ARRAY: u64 = 1 << 16;

/// The reader and what is left of the file, so that every length is checked first.
struct Cursor<R> {
    r: R,
    pos: u64,
    size: u64,
}

impl<R: Read + Seek> Cursor<R> {
    fn left(&self) -> u64 {
        self.size - self.pos
    }

    fn bytes<const N: usize>(&mut self) -> Parse<[u8; N]> {
        if (N as u64) > self.left() {
            return Err(format!(
                "the file ends at byte {} inside the header",
                self.size
            ));
        }
        let mut b = [0u8; N];
        self.r.read_exact(&mut b).map_err(|e| e.to_string())?;
        self.pos += N as u64;
        Ok(b)
    }

    fn u32(&mut self) -> Parse<u32> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }

    fn u64(&mut self) -> Parse<u64> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }

    /// `n` elements of at least `each` bytes must fit in what is left.
    fn fits(&self, n: u64, each: u64, what: &str) -> Parse<()> {
        match n.checked_mul(each) {
            Some(need) if need <= self.left() => Ok(()),
            _ => Err(format!(
                "{what}: {n} entries do not fit in the {} bytes left",
                self.left()
            )),
        }
    }

    fn skip(&mut self, n: u64) -> Parse<()> {
        self.fits(n, 1, "skipped bytes")?;
        self.r.seek_relative(n as i64).map_err(|e| e.to_string())?;
        self.pos += n;
        Ok(())
    }

    fn string(&mut self, max: u64, what: &str) -> Parse<String> {
        let len = self.u64()?;
        if len > max {
            return Err(format!("{what} is {len} bytes long, more than {max}"));
        }
        self.fits(len, 1, what)?;
        let mut b = vec![0u8; len as usize];
        self.r.read_exact(&mut b).map_err(|e| e.to_string())?;
        self.pos += len;
        // As candle reads them: GGUF does not promise UTF-8 (a byte-level token may not be).
        Ok(String::from_utf8_lossy(&b).into_owned())
    }
}

/// GGUF's value types: (id, bytes on disk of one fixed-size value).
fn fixed_size(ty: u32) -> Option<u64> {
    match ty {
        0 | 1 | 7 => Some(1),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        10..=12 => Some(8),
        _ => None,
    }
}

fn scalar<R: Read + Seek>(c: &mut Cursor<R>, ty: u32) -> Parse<Value> {
    Ok(match ty {
        0 => Value::U8(c.bytes::<1>()?[0]),
        1 => Value::I8(c.bytes::<1>()?[0] as i8),
        2 => Value::U16(u16::from_le_bytes(c.bytes()?)),
        3 => Value::I16(i16::from_le_bytes(c.bytes()?)),
        4 => Value::U32(c.u32()?),
        5 => Value::I32(i32::from_le_bytes(c.bytes()?)),
        6 => Value::F32(f32::from_le_bytes(c.bytes()?)),
        7 => match c.bytes::<1>()?[0] {
            0 => Value::Bool(false),
            1 => Value::Bool(true),
            b => return Err(format!("a bool is {b}, not 0 or 1")),
        },
        8 => Value::String(c.string(MAX_STRING, "a string")?),
        10 => Value::U64(c.u64()?),
        11 => Value::I64(i64::from_le_bytes(c.bytes()?)),
        12 => Value::F64(f64::from_le_bytes(c.bytes()?)),
        9 => return Err("an array inside an array is not supported".into()),
        t => return Err(format!("value type {t} is not a GGUF type")),
    })
}

/// One value of type `ty`; `None` for a large array under a key the loader never reads.
fn value<R: Read + Seek>(c: &mut Cursor<R>, key: &str, ty: u32) -> Parse<Option<Value>> {
    if ty != 9 {
        return scalar(c, ty).map(Some);
    }
    let item = c.u32()?;
    let n = c.u64()?;
    let each = match item {
        8 => 8, // a string is at least its length
        t => fixed_size(t).ok_or_else(|| match t {
            9 => "an array inside an array is not supported".to_string(),
            t => format!("array element type {t} is not a GGUF type"),
        })?,
    };
    c.fits(n, each, "an array")?;
    let limit = match key.starts_with("tokenizer.ggml.") {
        true => MAX_VOCAB_ARRAY,
        false => MAX_OTHER_ARRAY,
    };
    if n <= limit {
        let items = (0..n).map(|_| scalar(c, item)).collect::<Parse<_>>()?;
        return Ok(Some(Value::Array(items)));
    }
    if key.starts_with("tokenizer.ggml.") {
        return Err(format!("an array of {n} elements, more than {limit}"));
    }
    match item {
        8 => {
            for _ in 0..n {
                let len = c.u64()?;
                c.skip(len)?;
            }
        }
        _ => c.skip(n * each)?,
    }
    Ok(None)
}

/// Reads and checks `path`'s header; errors name the file and the key or tensor.
pub fn read(path: &Path) -> Result<Content> {
    let file = std::fs::File::open(path).map_err(|e| Error::file(path, e))?;
    let size = file.metadata().map_err(|e| Error::file(path, e))?.len();
    let mut c = Cursor {
        r: BufReader::with_capacity(1 << 16, file),
        pos: 0,
        size,
    };
    header(&mut c).map_err(|e| Error::file(path, format!("not a valid GGUF file: {e}")))
}

fn header<R: Read + Seek>(c: &mut Cursor<R>) -> Parse<Content> {
    if &c.bytes::<4>()? != b"GGUF" {
        return Err("it does not start with GGUF's magic".into());
    }
    let magic = match c.u32()? {
        2 => VersionedMagic::GgufV2,
        3 => VersionedMagic::GgufV3,
        v => return Err(format!("version {v} is not supported (2 or 3)")),
    };
    let n_tensors = c.u64()?;
    let n_kv = c.u64()?;
    // A key-value pair takes at least 13 bytes, a tensor's entry at least 24.
    c.fits(n_kv, 13, "metadata")?;
    c.fits(n_tensors, 24, "the tensor table")?;

    let mut metadata = HashMap::new();
    for _ in 0..n_kv {
        let key = c.string(MAX_KEY, "a metadata key")?;
        let ty = c.u32()?;
        let v = value(c, &key, ty).map_err(|e| format!("metadata key {key}: {e}"))?;
        if metadata.contains_key(&key) {
            return Err(format!("metadata key {key} appears twice"));
        }
        if let Some(v) = v {
            metadata.insert(key, v);
        }
    }
    let alignment = match metadata.get("general.alignment") {
        None => 32,
        Some(Value::U32(a)) if a.is_power_of_two() => *a as u64,
        Some(v) => {
            return Err(format!(
                "metadata key general.alignment must be a u32 power of two, got {v:?}"
            ))
        }
    };

    let mut table = Vec::new();
    for _ in 0..n_tensors {
        let name = c.string(MAX_NAME as u64 - 1, "a tensor name")?;
        let t = tensor_info(c).map_err(|e| format!("tensor {name}: {e}"))?;
        table.push((name, t));
    }
    let tensor_data_offset = c.pos.next_multiple_of(alignment);

    // Each tensor's data where the previous one's padded data ended, inside the file.
    let mut expected = 0u64;
    let mut tensor_infos = HashMap::new();
    for (name, t) in table {
        let bytes = byte_size(&t).ok_or_else(|| format!("tensor {name}: too large"))?;
        if t.offset != expected {
            return Err(format!(
                "tensor {name}: its data is at offset {}, expected {expected} (data must be \
                 contiguous and aligned to {alignment}, in table order)",
                t.offset
            ));
        }
        let end = tensor_data_offset
            .checked_add(expected)
            .and_then(|start| start.checked_add(bytes))
            .filter(|&end| end <= c.size)
            .ok_or_else(|| {
                format!(
                    "truncated or corrupt: tensor {name} ({:?}, {bytes} bytes) ends past the \
                     end of the file ({} bytes)",
                    t.ggml_dtype, c.size
                )
            })?;
        expected = (end - tensor_data_offset).next_multiple_of(alignment);
        if tensor_infos.insert(name.clone(), t).is_some() {
            return Err(format!("tensor {name} appears twice"));
        }
    }
    Ok(Content {
        magic,
        metadata,
        tensor_infos,
        tensor_data_offset,
    })
}
