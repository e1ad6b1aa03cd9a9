//! One sequence being generated ([`Sequence`]) and the loop that runs one or many of them
//! through the model's batched step together ([`run`]).

use super::{stop, Generation, Options, StopReason, StopStrings, TokenStream};
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::model::{Feed, Transformer};
use crate::sampling::Sampler;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;
use tokenizers::Tokenizer;

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
