//! `tojson` as transformers defines it in Python, rewritten to give the same text: Python's
//! `json.dumps`, not minijinja's HTML-safe filter. (`strftime_now`, its other function, is
//! in `time`.)

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};
use std::fmt::Write;

/// `x | tojson(ensure_ascii=False, indent=None, separators=None, sort_keys=False)`: the
/// text of Python's `json.dumps` with those arguments, byte for byte.
pub fn tojson(value: &Value, kwargs: Kwargs) -> Result<String, Error> {
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    // json.dumps: an int indent means that many spaces, a negative one none.
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) if n > MAX_INDENT as i64 => {
                return Err(invalid(format!(
                    "tojson: indent {n} is more than {MAX_INDENT}"
                )))
            }
            (_, Some(s)) if s.len() > MAX_INDENT => {
                return Err(invalid(format!(
                    "tojson: an indent of {} bytes is more than {MAX_INDENT}",
                    s.len()
                )))
            }
            (Some(n), _) => Some(" ".repeat(n.max(0) as usize)),
            (_, Some(s)) => Some(s.to_string()),
            _ => {
                return Err(invalid(format!(
                    "tojson: indent must be an int or str, not {v}"
                )))
            }
        },
    };
    // Default separators: (", ", ": "), or ("," , ": ") when indenting.
    let (item_sep, key_sep) = match kwargs.get::<Option<Vec<String>>>("separators")? {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => return Err(invalid("tojson: separators must be two strings".into())),
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    kwargs.assert_all_used()?;
    let mut json = Json {
        ensure_ascii,
        sort_keys,
        indent,
        item_sep,
        key_sep,
        out: String::new(),
    };
    json.value(value, 0)?;
    Ok(json.out)
}

/// Bounds on what a template can make `tojson` build: the text a render builds is bounded
/// by minijinja's fuel, but a filter's own work is charged only for what it returns.
const MAX_INDENT: usize = 64;
const MAX_JSON: usize = 16 << 20;

pub(super) fn invalid(msg: String) -> Error {
    Error::new(ErrorKind::InvalidOperation, msg)
}

/// One `json.dumps` call: its options and the text so far.
struct Json {
    ensure_ascii: bool,
    sort_keys: bool,
    /// `None`: everything on one line; `Some(unit)`: one item per line, `unit` per level.
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    out: String,
}

impl Json {
    fn value(&mut self, v: &Value, depth: usize) -> Result<(), Error> {
        if self.out.len() > MAX_JSON {
            return Err(invalid(format!(
                "tojson: the text is over {MAX_JSON} bytes"
            )));
        }
        match v.kind() {
            ValueKind::None => self.out.push_str("null"),
            ValueKind::Bool => self
                .out
                .push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number if v.is_integer() => self.out.push_str(&v.to_string()),
            ValueKind::Number => self.out.push_str(&py_float(f64::try_from(v.clone())?)),
            ValueKind::String => self.string(v.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.container('[', ']', &items, depth, |json, item, depth| {
                    json.value(item, depth)
                })?
            }
            ValueKind::Map => {
                let mut keys: Vec<(String, Value)> = v
                    .try_iter()?
                    .map(|k| Ok((json_key(&k)?, k)))
                    .collect::<Result<_, Error>>()?;
                if self.sort_keys {
                    keys.sort_by(|a, b| a.0.cmp(&b.0));
                }
                self.container('{', '}', &keys, depth, |json, (name, key), depth| {
                    json.string(name);
                    json.out.push_str(&json.key_sep.clone());
                    json.value(&v.get_item(key)?, depth)
                })?
            }
            _ => {
                return Err(invalid(format!(
                    "tojson: a {} is not JSON serializable",
                    v.kind()
                )))
            }
        }
        Ok(())
    }

    /// `[a, b]` or `{..}`: items separated and, when indenting, one per line.
    fn container<T>(
        &mut self,
        open: char,
        close: char,
        items: &[T],
        depth: usize,
        mut item: impl FnMut(&mut Self, &T, usize) -> Result<(), Error>,
    ) -> Result<(), Error> {
        self.out.push(open);
        if items.is_empty() {
            self.out.push(close);
            return Ok(());
        }
        for (i, x) in items.iter().enumerate() {
            if i > 0 {
                self.out.push_str(&self.item_sep.clone());
            }
            self.newline(depth + 1);
            item(self, x, depth + 1)?;
        }
        self.newline(depth);
        self.out.push(close);
        Ok(())
    }

    fn newline(&mut self, depth: usize) {
        if let Some(unit) = &self.indent {
            self.out.push('\n');
            self.out.push_str(&unit.repeat(depth));
        }
    }

    /// A JSON string as Python writes it: `\n`-style escapes, other controls as `\u00XX`,
    /// and with `ensure_ascii` everything outside ' '..='~' as `\uXXXX` (surrogate pairs).
    fn string(&mut self, s: &str) {
        self.out.push('"');
        for c in s.chars() {
            match c {
                '"' => self.out.push_str("\\\""),
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                '\r' => self.out.push_str("\\r"),
                '\t' => self.out.push_str("\\t"),
                '\u{8}' => self.out.push_str("\\b"),
                '\u{c}' => self.out.push_str("\\f"),
                c if c < ' ' || (self.ensure_ascii && c > '~') => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        let _ = write!(self.out, "\\u{unit:04x}");
                    }
                }
                c => self.out.push(c),
            }
        }
        self.out.push('"');
    }
}

/// A dict key as json.dumps writes it: str as is; int, float, bool and None as text.
fn json_key(k: &Value) -> Result<String, Error> {
    match k.kind() {
        ValueKind::String => Ok(k.as_str().unwrap_or_default().to_string()),
        ValueKind::None => Ok("null".into()),
        ValueKind::Bool => Ok(if k.is_true() { "true" } else { "false" }.into()),
        ValueKind::Number if k.is_integer() => Ok(k.to_string()),
        ValueKind::Number => Ok(py_float(f64::try_from(k.clone())?)),
        _ => Err(invalid(format!(
            "tojson: keys must be str, int, float, bool or None, not {k}"
        ))),
    }
}

/// Python's `repr(float)`: shortest round-trip digits, exponent form outside 1e-4..1e16.
fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let sci = format!("{f:e}"); // "1.5e16", "-1e-5"
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let fixed = f.to_string();
        return if fixed.contains('.') {
            fixed
        } else {
            fixed + ".0"
        };
    }
    let sign = if exp < 0 { '-' } else { '+' };
    format!("{mantissa}e{sign}{:02}", exp.abs())
}
