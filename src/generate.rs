//! Generation: prefill the prompt in one forward, then one token per step until an EOS id,
//! the token budget or the end of the cache. Text streams out as it is produced, never
//! splitting a multi-byte character. Knows nothing of weights: a model, a tokenizer, a sampler.

use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::model::Transformer;
use crate::sampling::Sampler;
use candle_core::Device;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;
use tokenizers::Tokenizer;

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The model produced one of the EOS ids.
    Eos,
    /// `max_new_tokens` were generated.
    Length,
    /// The cache reached the model's context length.
    Context,
    /// The caller asked to stop (Ctrl-C).
    Interrupted,
}

impl StopReason {
    /// The `stop_reason` of `--json`: `eos`, `length` (the context limit is a length limit)
    /// or `interrupted`.
    pub fn as_str(&self) -> &'static str {
        match self {
            StopReason::Eos => "eos",
            StopReason::Length | StopReason::Context => "length",
            StopReason::Interrupted => "interrupted",
        }
    }
}

/// The result of one generation with its statistics.
#[derive(Debug, Clone)]
pub struct Generation {
    pub prompt_token_ids: Vec<u32>,
    /// Generated ids, the stop token excluded.
    pub token_ids: Vec<u32>,
    pub text: String,
    pub stop_reason: StopReason,
    pub prefill_secs: f64,
    /// Forward passes of one token each, and the time they took (sampling included).
    pub decode_steps: usize,
    pub decode_secs: f64,
    /// Bytes the cache holds at the end.
    pub kv_cache_bytes: usize,
    pub kv_bytes_per_token: usize,
}

impl Generation {
    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.prompt_token_ids.len() as f64 / self.prefill_secs.max(1e-9)
    }

    pub fn decode_tokens_per_s(&self) -> f64 {
        self.decode_steps as f64 / self.decode_secs.max(1e-9)
    }
}

/// Turns a growing list of ids into text pieces without splitting a character: holds text
/// back while the decoder's output ends in U+FFFD (an incomplete UTF-8 sequence), and decodes
/// a window that starts one emitted chunk back so tokenizers that strip a leading space at the
/// start of a decode (SentencePiece) keep the spaces between chunks.
pub struct TokenStream<'a> {
    tokenizer: &'a Tokenizer,
    tokens: Vec<u32>,
    prev: usize,
    current: usize,
}

impl<'a> TokenStream<'a> {
    /// `context`: ids before the first streamed one (e.g. the prompt's last token), not emitted.
    pub fn new(tokenizer: &'a Tokenizer, context: &[u32]) -> Self {
        Self {
            tokenizer,
            tokens: context.to_vec(),
            prev: 0,
            current: context.len(),
        }
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// Adds a token and returns the text that became complete, if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        let before = self.decode(&self.tokens[self.prev..self.current])?;
        self.tokens.push(id);
        let now = self.decode(&self.tokens[self.prev..])?;
        if now.len() > before.len() && !now.ends_with('\u{FFFD}') && now.starts_with(&before) {
            self.prev = self.current;
            self.current = self.tokens.len();
            return Ok(Some(now[before.len()..].to_string()));
        }
        Ok(None)
    }

    /// Whatever is still held back at the end.
    pub fn flush(&self) -> Result<Option<String>> {
        let before = self.decode(&self.tokens[self.prev..self.current])?;
        let now = self.decode(&self.tokens[self.prev..])?;
        Ok((now.len() > before.len() && now.starts_with(&before))
            .then(|| now[before.len()..].to_string()))
    }
}

/// Generates up to `max_new_tokens` after `prompt_ids`, calling `on_text` with each complete
/// piece of text. The cache is sized for prompt + new tokens, capped at the context length.
pub fn generate(
    model: &Transformer,
    tokenizer: &Tokenizer,
    prompt_ids: &[u32],
    max_new_tokens: usize,
    sampler: &mut Sampler,
    on_text: impl FnMut(&str),
) -> Result<Generation> {
    let never = AtomicBool::new(false);
    generate_until(
        model,
        tokenizer,
        prompt_ids,
        max_new_tokens,
        sampler,
        on_text,
        &never,
    )
}

/// [`generate`] that also stops, with [`StopReason::Interrupted`], once `interrupt` is set
/// (checked before every decode step).
pub fn generate_until(
    model: &Transformer,
    tokenizer: &Tokenizer,
    prompt_ids: &[u32],
    max_new_tokens: usize,
    sampler: &mut Sampler,
    mut on_text: impl FnMut(&str),
    interrupt: &AtomicBool,
) -> Result<Generation> {
    let cfg = model.config();
    let context = cfg.max_position_embeddings;
    if prompt_ids.is_empty() {
        return Err(Error::Invalid("the prompt encodes to no tokens".into()));
    }
    if prompt_ids.len() >= context {
        return Err(Error::Invalid(format!(
            "the prompt is {} tokens but the context length is {context}: shorten the prompt",
            prompt_ids.len()
        )));
    }
    let capacity = prompt_ids.len().saturating_add(max_new_tokens).min(context);
    let device: &Device = model.device();
    let mut cache = KvCache::new(cfg, capacity, model.dtype(), device)?;
    let mut history = prompt_ids.to_vec();
    let mut stream = TokenStream::new(tokenizer, &prompt_ids[prompt_ids.len() - 1..]);
    let mut token_ids = Vec::new();
    let mut decode_steps = 0;

    let start = Instant::now();
    let mut logits = model.next_logits(prompt_ids, &mut cache)?;
    let prefill_secs = start.elapsed().as_secs_f64();

    let start = Instant::now();
    let stop_reason = loop {
        if interrupt.load(Ordering::Relaxed) {
            break StopReason::Interrupted;
        }
        if token_ids.len() == max_new_tokens {
            break StopReason::Length;
        }
        let next = sampler.sample(&logits, &history);
        if cfg.eos_token_ids.contains(&next) {
            break StopReason::Eos;
        }
        token_ids.push(next);
        history.push(next);
        if let Some(text) = stream.push(next)? {
            on_text(&text);
        }
        if token_ids.len() == max_new_tokens {
            break StopReason::Length;
        }
        if cache.len() == cache.capacity() {
            break StopReason::Context;
        }
        decode_steps += 1;
        logits = model.next_logits(&[next], &mut cache)?;
    };
    if let Some(text) = stream.flush()? {
        on_text(&text);
    }
    let decode_secs = start.elapsed().as_secs_f64();
    let text = tokenizer
        .decode(&token_ids, true)
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
    Ok(Generation {
        prompt_token_ids: prompt_ids.to_vec(),
        token_ids,
        text,
        stop_reason,
        prefill_secs,
        decode_steps,
        decode_secs,
        kv_cache_bytes: cache.bytes_in_use(),
        kv_bytes_per_token: cache.bytes_per_token(),
    })
}
