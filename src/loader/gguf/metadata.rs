//! A GGUF file's metadata read by key: typed look-ups whose errors name the file and the key
//! (`model.gguf: metadata key llama.block_count is missing`). GGUF writers differ in the
//! integer and float widths they use for the same key, so every integer type reads as an
//! integer and both float types as a float; but a float key holding an integer, or a float
//! that is not finite, is refused.

use crate::error::{Error, Result};
use candle_core::quantized::gguf_file::Value;
use std::collections::HashMap;
use std::path::Path;

/// The metadata of one file, with the file's path for messages.
pub(super) struct Meta<'a> {
    pub path: &'a Path,
    pub map: &'a HashMap<String, Value>,
}

fn int(v: &Value) -> Option<i64> {
    match *v {
        Value::U8(x) => Some(x.into()),
        Value::I8(x) => Some(x.into()),
        Value::U16(x) => Some(x.into()),
        Value::I16(x) => Some(x.into()),
        Value::U32(x) => Some(x.into()),
        Value::I32(x) => Some(x.into()),
        Value::U64(x) => i64::try_from(x).ok(),
        Value::I64(x) => Some(x),
        _ => None,
    }
}

/// A finite float; an integer is refused, as llama.cpp refuses it (a float's bits written as
/// an integer would read as another number).
fn float(v: &Value) -> Option<f64> {
    any_float(v).filter(|x| x.is_finite())
}

fn any_float(v: &Value) -> Option<f64> {
    match *v {
        Value::F32(x) => Some(x.into()),
        Value::F64(x) => Some(x),
        _ => None,
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::F32(_) | Value::F64(_) if float(v).is_none() => "not finite",
        Value::F32(_) | Value::F64(_) => "a float",
        Value::Bool(_) => "a bool",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        _ => "an integer",
    }
}

impl Meta<'_> {
    /// An error about `key`, naming the file.
    pub fn error(&self, key: &str, msg: impl std::fmt::Display) -> Error {
        Error::file(self.path, format!("metadata key {key} {msg}"))
    }

    /// `key`'s value read by `read`; `None` when the key is absent, an error naming the key
    /// and what it holds when the type is wrong.
    fn typed<'v, T>(
        &'v self,
        key: &str,
        want: &str,
        read: impl Fn(&'v Value) -> Option<T>,
    ) -> Result<Option<T>> {
        let Some(v) = self.map.get(key) else {
            return Ok(None);
        };
        match read(v) {
            Some(x) => Ok(Some(x)),
            None => Err(self.error(key, format!("is {}, expected {want}", type_name(v)))),
        }
    }

    fn required<T>(&self, key: &str, value: Option<T>) -> Result<T> {
        value.ok_or_else(|| self.error(key, "is missing"))
    }

    pub fn opt_int(&self, key: &str) -> Result<Option<i64>> {
        self.typed(key, "an integer", int)
    }

    pub fn int(&self, key: &str) -> Result<i64> {
        self.required(key, self.opt_int(key)?)
    }

    /// A token id or an index: a non-negative integer.
    pub fn opt_index(&self, key: &str) -> Result<Option<usize>> {
        self.typed(key, "a non-negative integer", |v| {
            int(v).and_then(|x| usize::try_from(x).ok())
        })
    }

    pub fn opt_float(&self, key: &str) -> Result<Option<f64>> {
        self.typed(key, "a finite float", float)
    }

    pub fn float(&self, key: &str) -> Result<f64> {
        self.required(key, self.opt_float(key)?)
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.typed(key, "a bool", |v| match v {
            Value::Bool(b) => Some(*b),
            _ => None,
        })
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        self.typed(key, "a string", |v| match v {
            Value::String(s) => Some(s.as_str()),
            _ => None,
        })
    }

    pub fn str(&self, key: &str) -> Result<&str> {
        self.required(key, self.opt_str(key)?)
    }

    /// An array whose every element `read` accepts.
    fn array<'v, T>(
        &'v self,
        key: &str,
        want: &str,
        read: impl Fn(&'v Value) -> Option<T>,
    ) -> Result<Option<Vec<T>>> {
        self.typed(key, want, |v| match v {
            Value::Array(items) => items.iter().map(&read).collect(),
            _ => None,
        })
    }

    pub fn opt_strings(&self, key: &str) -> Result<Option<Vec<&str>>> {
        self.array(key, "an array of strings", |v| match v {
            Value::String(s) => Some(s.as_str()),
            _ => None,
        })
    }

    pub fn strings(&self, key: &str) -> Result<Vec<&str>> {
        self.required(key, self.opt_strings(key)?)
    }

    pub fn opt_ints(&self, key: &str) -> Result<Option<Vec<i64>>> {
        self.array(key, "an array of integers", int)
    }

    pub fn opt_floats(&self, key: &str) -> Result<Option<Vec<f64>>> {
        // Scores may be -inf (a token never merged into): any float, but not an integer.
        self.array(key, "an array of floats", any_float)
    }
}
