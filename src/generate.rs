//! Generation: prefill the prompt (after what the cache already holds), then one token per
//! step until an EOS id, a stop string, the token budget or the end of the cache. Text streams out as it is produced, never
//! splitting a multi-byte character. Knows nothing of weights: a model, a tokenizer, a sampler.

mod sequence;
mod stop;

pub use sequence::{check_fits, run, Sequence};

pub use stop::{first_match, StopStrings};

use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::model::Transformer;
use crate::sampling::Sampler;
use std::sync::atomic::AtomicBool;
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
    /// The text reached one of the stop strings.
    Stop,
}

impl StopReason {
    /// The `stop_reason` of `--json`: `eos`, `length` (the context limit is a length limit),
    /// `stop` or `interrupted`.
    pub fn as_str(&self) -> &'static str {
        match self {
            StopReason::Eos => "eos",
            StopReason::Length | StopReason::Context => "length",
            StopReason::Interrupted => "interrupted",
            StopReason::Stop => "stop",
        }
    }
}

/// The result of one generation with its statistics.
#[derive(Debug, Clone)]
pub struct Generation {
    pub prompt_token_ids: Vec<u32>,
    /// Leading prompt tokens that were already in the cache (a chat turn's history): only
    /// the rest was prefilled.
    pub reused_tokens: usize,
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
    /// Prompt tokens run through the model this time.
    pub fn prefill_tokens(&self) -> usize {
        self.prompt_token_ids.len() - self.reused_tokens
    }

    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.prefill_tokens() as f64 / self.prefill_secs.max(1e-9)
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

/// What ends a generation besides the model's EOS ids, and who may interrupt it.
#[derive(Debug, Clone, Copy)]
pub struct Options<'a> {
    pub max_new_tokens: usize,
    /// Text that ends generation; it and what follows are not part of the output.
    pub stop: &'a [String],
    /// Checked before every decode step; once set, generation stops as `Interrupted`.
    pub interrupt: Option<&'a AtomicBool>,
    /// Generate past the model's EOS ids, up to `max_new_tokens` (the server's `ignore_eos`).
    pub ignore_eos: bool,
    /// Keep each generated token's log-probability and this many most likely alternatives
    /// ([`Sequence::logprobs`]); `None`: none (no cost).
    pub logprobs: Option<usize>,
}

impl Options<'_> {
    pub fn new(max_new_tokens: usize) -> Self {
        Self {
            max_new_tokens,
            stop: &[],
            interrupt: None,
            ignore_eos: false,
            logprobs: None,
        }
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
    let opts = Options::new(max_new_tokens);
    let mut cache = cache_for(model, prompt_ids.len(), max_new_tokens)?;
    generate_in(
        model, tokenizer, &mut cache, prompt_ids, opts, sampler, on_text,
    )
}

/// A cache for `prompt` + `new` tokens, capped at the model's context length.
pub fn cache_for(model: &Transformer, prompt: usize, new: usize) -> Result<KvCache> {
    model.new_cache(capacity(model, prompt, new))
}

/// Positions for `prompt` + `new` tokens, capped at the model's context length.
pub fn capacity(model: &Transformer, prompt: usize, new: usize) -> usize {
    prompt
        .saturating_add(new)
        .min(model.config().max_position_embeddings)
}

/// Generates after `prompt_ids` into `cache`, which may already hold a prefix of them: the
/// caller guarantees its first `cache.len()` positions are `prompt_ids[..cache.len()]` (a
/// chat turn's shared history), and only the rest is prefilled (at least the last prompt
/// token, for its logits). At the end the cache holds the prompt and every generated token
/// but the last (which was never fed back).
pub fn generate_in(
    model: &Transformer,
    tokenizer: &Tokenizer,
    cache: &mut KvCache,
    prompt_ids: &[u32],
    opts: Options<'_>,
    sampler: &mut Sampler,
    mut on_text: impl FnMut(&str),
) -> Result<Generation> {
    let mut seq = [Sequence::new(
        model, tokenizer, cache, prompt_ids, opts, sampler,
    )?];
    run(model, &mut seq, opts.interrupt, |_, text| on_text(text))?;
    let [seq] = seq;
    seq.finish()
}
