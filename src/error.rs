//! The library's error type: every failure names the file, tensor, field or flag involved.

use std::path::PathBuf;

/// Errors from loading, validating and running a model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A config field is missing, malformed, or describes a model the engine cannot run.
    #[error("config.json: {0}")]
    Config(String),
    /// A file could not be read or parsed.
    #[error("{}: {msg}", path.display())]
    File { path: PathBuf, msg: String },
    /// A checkpoint's tensors do not match its config.
    #[error("{0}")]
    Weights(String),
    /// The tokenizer failed to load, encode or decode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A request the model cannot serve (prompt too long, bad sampling parameter, ...).
    #[error("{0}")]
    Invalid(String),
    /// A chat template failed to compile or render (`line`: the template's line, 1-based).
    #[error("chat template{}: {msg}", line.map(|l| format!(", line {l}")).unwrap_or_default())]
    Template { line: Option<usize>, msg: String },
    /// The server could not start or stopped with an error (an address in use, ...).
    #[error("{0}")]
    Serve(String),
    #[error("{}", candle_message(.0))]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn file(path: impl Into<PathBuf>, msg: impl std::fmt::Display) -> Self {
        Error::File {
            path: path.into(),
            msg: msg.to_string(),
        }
    }
}

/// A candle error as one line: no backtrace, context and path folded in.
pub fn candle_message(e: &candle_core::Error) -> String {
    use candle_core::Error as E;
    match e {
        E::WithBacktrace { inner, .. } => candle_message(inner),
        E::Context { inner, context } => format!("{context}: {}", candle_message(inner)),
        E::WithPath { inner, path } => {
            let inner = candle_message(inner);
            let path = path.display().to_string();
            match inner.starts_with(&path) {
                true => inner,
                false => format!("{path}: {inner}"),
            }
        }
        other => other
            .to_string()
            .lines()
            .next()
            .unwrap_or_default()
            .to_string(),
    }
}
