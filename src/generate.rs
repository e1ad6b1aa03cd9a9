//! Generation: prefill the prompt (after what the cache already holds), then one token per
//! step until an EOS id, a stop string, the token budget or the end of the cache. Text streams out as it is produced, never
//! splitting a multi-byte character. Knows nothing of weights: a model, a tokenizer, a sampler.

mod stop;

pub use stop::{first_match, StopStrings};

use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::model::{Feed, Transformer};
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
}

impl Options<'_> {
    pub fn new(max_new_tokens: usize) -> Self {
        Self {
            max_new_tokens,
            stop: &[],
            interrupt: None,
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
    let cfg = model.config();
    let capacity = prompt.saturating_add(new).min(cfg.max_position_embeddings);
    let device: &Device = model.device();
    KvCache::new(cfg, capacity, model.dtype(), device)
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

/// Runs `seqs` to their ends together: each step feeds every unfinished sequence (its prompt
/// first, then its last token) through one [`Transformer::next_logits_batch`], so the
/// weights are read once per step for all of them. `on_text(i, piece)` streams sequence i's
/// text. `interrupt`, checked after every step, ends them all as `Interrupted`.
pub fn run(
    model: &Transformer,
    seqs: &mut [Sequence<'_>],
    interrupt: Option<&AtomicBool>,
    mut on_text: impl FnMut(usize, &str),
) -> Result<()> {
    loop {
        let start = Instant::now();
        let mut feeds: Vec<Feed> = seqs.iter_mut().filter_map(Sequence::feed).collect();
        if feeds.is_empty() {
            return Ok(());
        }
        let logits = model.next_logits_batch(&mut feeds)?;
        drop(feeds);
        let interrupted = interrupt.is_some_and(|i| i.load(Ordering::Relaxed));
        let running = seqs
            .iter_mut()
            .enumerate()
            .filter(|(_, s)| s.stop.is_none());
        for ((i, seq), logits) in running.zip(logits) {
            let mut emit = |text: &str| on_text(i, text);
            match interrupted {
                true => seq.end(StopReason::Interrupted, &mut emit)?,
                false => seq.accept(&logits, &mut emit)?,
            }
            seq.spend(start.elapsed().as_secs_f64());
        }
    }
}

/// One sequence being generated: its cache and sampler, the tokens so far, the text stream
/// and stop strings. [`run`] drives one or many of them; the server's scheduler can too.
pub struct Sequence<'a> {
    tokenizer: &'a Tokenizer,
    cache: &'a mut KvCache,
    sampler: &'a mut Sampler,
    opts: Options<'a>,
    eos: Vec<u32>,
    prompt_ids: Vec<u32>,
    reused: usize,
    /// Prompt and generated ids (the repeat penalty's window).
    history: Vec<u32>,
    /// What the next step feeds: the unprefilled prompt, then the last sampled token.
    pending: Vec<u32>,
    stream: TokenStream<'a>,
    stops: StopStrings,
    token_ids: Vec<u32>,
    stop: Option<StopReason>,
    /// Steps taken: the first prefilled.
    steps: usize,
    prefill_secs: f64,
    decode_steps: usize,
    decode_secs: f64,
}

impl<'a> Sequence<'a> {
    /// Checks that the prompt fits `cache` and keeps the prefix the cache already holds.
    pub fn new(
        model: &Transformer,
        tokenizer: &'a Tokenizer,
        cache: &'a mut KvCache,
        prompt_ids: &[u32],
        opts: Options<'a>,
        sampler: &'a mut Sampler,
    ) -> Result<Self> {
        let cfg = model.config();
        let context = cfg.max_position_embeddings;
        if prompt_ids.is_empty() {
            return Err(Error::Invalid("the prompt encodes to no tokens".into()));
        }
        if prompt_ids.len() >= context.min(cache.capacity() + 1) {
            return Err(Error::Invalid(format!(
                "the prompt is {} tokens but the context length is {}: shorten the prompt",
                prompt_ids.len(),
                context.min(cache.capacity())
            )));
        }
        let reused = cache.len().min(prompt_ids.len() - 1);
        cache.truncate(reused);
        Ok(Self {
            tokenizer,
            cache,
            sampler,
            opts,
            eos: cfg.eos_token_ids.clone(),
            prompt_ids: prompt_ids.to_vec(),
            reused,
            history: prompt_ids.to_vec(),
            pending: prompt_ids[reused..].to_vec(),
            stream: TokenStream::new(tokenizer, &prompt_ids[prompt_ids.len() - 1..]),
            stops: StopStrings::new(opts.stop),
            token_ids: Vec::new(),
            stop: None,
            steps: 0,
            prefill_secs: 0.0,
            decode_steps: 0,
            decode_secs: 0.0,
        })
    }

    /// The ids to feed this step with the cache they go into, or `None` once finished.
    pub fn feed(&mut self) -> Option<Feed<'_>> {
        self.stop.is_none().then(|| Feed {
            ids: &self.pending,
            cache: &mut *self.cache,
        })
    }

    /// Why it stopped, once it has.
    pub fn stop_reason(&self) -> Option<StopReason> {
        self.stop
    }

    /// Takes the logits of the step that fed [`Sequence::feed`]: samples the next token and
    /// either queues it for the next step or ends the sequence.
    pub fn accept(&mut self, logits: &[f32], on_text: &mut dyn FnMut(&str)) -> Result<()> {
        let max = self.opts.max_new_tokens;
        if self.token_ids.len() == max {
            return self.end(StopReason::Length, on_text);
        }
        let next = self.sampler.sample(logits, &self.history);
        if self.eos.contains(&next) {
            return self.end(StopReason::Eos, on_text);
        }
        self.token_ids.push(next);
        self.history.push(next);
        if let Some(text) = self.stream.push(next)? {
            let (shown, stopped) = self.stops.push(&text);
            on_text(&shown);
            if stopped {
                self.stop = Some(StopReason::Stop);
                return Ok(());
            }
        }
        if self.token_ids.len() == max {
            return self.end(StopReason::Length, on_text);
        }
        if self.cache.len() == self.cache.capacity() {
            return self.end(StopReason::Context, on_text);
        }
        self.pending = vec![next];
        Ok(())
    }

    /// Ends the sequence, emitting the text still held back.
    pub fn end(&mut self, reason: StopReason, on_text: &mut dyn FnMut(&str)) -> Result<()> {
        let rest = self.stream.flush()?.map(|t| self.stops.push(&t).0);
        on_text(&(rest.unwrap_or_default() + &self.stops.finish()));
        self.stop = Some(reason);
        Ok(())
    }

    /// Counts a step's time: the first step prefilled, each later one decoded one token.
    fn spend(&mut self, secs: f64) {
        match self.steps {
            0 => self.prefill_secs = secs,
            _ => {
                self.decode_steps += 1;
                self.decode_secs += secs;
            }
        }
        self.steps += 1;
    }

    /// The result, once [`run`] has ended the sequence.
    pub fn finish(self) -> Result<Generation> {
        let mut text = self
            .tokenizer
            .decode(&self.token_ids, true)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        if let Some(at) = stop::first_match(&text, self.opts.stop) {
            text.truncate(at);
        }
        Ok(Generation {
            prompt_token_ids: self.prompt_ids,
            reused_tokens: self.reused,
            token_ids: self.token_ids,
            text,
            stop_reason: self.stop.unwrap_or(StopReason::Interrupted),
            prefill_secs: self.prefill_secs,
            decode_steps: self.decode_steps,
            decode_secs: self.decode_secs,
            kv_cache_bytes: self.cache.bytes_in_use(),
            kv_bytes_per_token: self.cache.bytes_per_token(),
        })
    }
}
