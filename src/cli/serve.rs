//! `serve`: load the model, size the caches, and hand both to the library's server
//! (`tiny_decoder::serve`), which runs until SIGINT or SIGTERM.

use super::args::ServeArgs;
use super::{chat_template, conversion_line, load_reported};
use anyhow::{bail, Context, Result};
use std::path::Path;
use std::time::Duration;
use tiny_decoder::loader::bundled;
use tiny_decoder::serve::{self, Limits, Model, Options};

/// The context a request may fill unless `--context` says otherwise: llama.cpp's default,
/// which bounds the caches of a model with a long context (each of `--max-batch` caches
/// holds this many tokens).
const DEFAULT_CONTEXT: usize = 4096;

/// The variable that sets the API key when `--api-key` is not given.
const API_KEY_VAR: &str = "TINY_DECODER_API_KEY";

pub fn run_serve(a: ServeArgs) -> Result<()> {
    if a.max_batch == 0 || a.max_queue == 0 {
        bail!("--max-batch and --max-queue must be at least 1");
    }
    let api_key = match a.api_key {
        Some(key) if key.is_empty() => bail!("--api-key: the key must not be empty"),
        Some(key) => Some(key),
        // An empty variable (`TINY_DECODER_API_KEY=`) means no key, as if unset.
        None => std::env::var(API_KEY_VAR).ok().filter(|k| !k.is_empty()),
    };
    if a.max_connections == 0 {
        bail!("--max-connections must be at least 1");
    }
    let limits = Limits {
        max_connections: a.max_connections,
        header_timeout: seconds("--header-timeout", a.header_timeout)?,
        body_timeout: seconds("--body-timeout", a.body_timeout)?,
        shutdown_timeout: seconds("--shutdown-timeout", a.shutdown_timeout)?,
    };
    let request_timeout = seconds("--request-timeout", a.request_timeout)?;
    let name = a.model.as_deref().unwrap_or(bundled::DEFAULT);
    // Not `load`: the memory moves into huge pages once the KV pool is in it too.
    let (mut loaded, report) = load_reported(name, &a.placement)?;
    if let Some(r) = report {
        eprintln!("{}", conversion_line(&r));
    }
    let max_context = loaded.model.config().max_position_embeddings;
    let context = match a.context {
        Some(c) if c == 0 || c > max_context => {
            bail!("--context {c}: must be between 1 and {name}'s context length ({max_context})")
        }
        Some(c) => c,
        None => max_context.min(DEFAULT_CONTEXT),
    };
    // What the KV cache of every sequence costs, and what that memory would hold.
    let cfg = loaded.model.config();
    let size = loaded.model.cache_dtype().size_in_bytes();
    let per_sequence = context * cfg.kv_bytes_per_token(size);
    // --kv-memory sizes the pool the sequences share: at least one whole --context, so
    // that any one request can always run (the others preempted).
    let kv_memory = match a.kv_memory {
        None => a.max_batch.saturating_mul(per_sequence),
        Some(bytes) if bytes < per_sequence => bail!(
            "--kv-memory {bytes}: holds no sequence of --context {context} tokens ({per_sequence} \
             bytes each for {name}): raise it, or lower --context"
        ),
        Some(bytes) => bytes,
    };
    let (tokens, seqs) = cfg.kv_capacity(size, 1_000_000_000, 4096);
    eprintln!(
        "KV cache: {} bytes per token ({}), {kv_memory} bytes: {} positions, {} full sequences \
         of {context} (more when shorter); 1 GB holds {tokens} tokens, {seqs} sequences of 4k",
        cfg.kv_bytes_per_token(size),
        cfg.attention_kind(),
        kv_memory / cfg.kv_bytes_per_token(size).max(1),
        kv_memory / per_sequence.max(1),
    );
    let template = chat_template(&loaded)?;
    let tokenizer = loaded
        .tokenizer
        .take()
        .with_context(|| format!("{name}: missing tokenizer.json (the server needs one)"))?;
    let model = Model {
        model: loaded.model,
        tokenizer,
        template,
        generation: loaded.generation,
    };
    let opts = Options {
        model_id: model_id(name),
        host: a.host,
        port: a.port,
        max_batch: a.max_batch,
        max_queue: a.max_queue,
        context,
        kv_memory,
        api_key,
        request_timeout,
        limits,
        allocated: super::huge_pages::in_background,
    };
    Ok(serve::run(model, opts)?)
}

/// A flag's positive number of seconds.
fn seconds(flag: &str, value: f64) -> Result<Duration> {
    match Duration::try_from_secs_f64(value) {
        Ok(t) if !t.is_zero() => Ok(t),
        _ => bail!("{flag} {value}: must be a positive number of seconds"),
    }
}

/// The id `/v1/models` lists: a directory's or file's name, else the argument itself (a
/// bundled name, a hub id such as `HuggingFaceTB/SmolLM2-135M-Instruct`).
fn model_id(model: &str) -> String {
    let path = Path::new(model);
    if !path.exists() {
        return model.to_string();
    }
    std::fs::canonicalize(path)
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| model.to_string())
}

/// A size in bytes: a number, or one with K, M, G (powers of 1000) or KiB, MiB, GiB.
pub fn parse_bytes(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        other => {
            return Err(format!(
                "unknown unit {other:?}: use K, M, G, KiB, MiB or GiB"
            ))
        }
    };
    let n: f64 = number
        .parse()
        .map_err(|_| format!("{s:?} is not a size (e.g. 2G)"))?;
    let bytes = n * scale;
    if !(bytes.is_finite() && bytes >= 1.0 && bytes < usize::MAX as f64) {
        return Err(format!("{s:?} is not a size of at least 1 byte"));
    }
    Ok(bytes as usize)
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn sizes_with_units() {
        assert_eq!(parse_bytes("1500"), Ok(1500));
        assert_eq!(parse_bytes("2G"), Ok(2_000_000_000));
        assert_eq!(parse_bytes("1.5GiB"), Ok(1_610_612_736));
        assert_eq!(parse_bytes("512M"), Ok(512_000_000));
        assert!(parse_bytes("0").is_err());
        assert!(parse_bytes("2X").is_err());
        assert!(parse_bytes("G").is_err());
    }
}
