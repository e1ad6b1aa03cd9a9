//! One request while it runs in the scheduler: its ids, its cache, its sampler, and what it
//! has streamed. It advances one token per step once its prompt is in the cache, and ends as
//! `generate` ends a generation (EOS id, stop string, `max_tokens`, the end of the cache).

use super::scheduler::{Event, Finish, Job};
use crate::error::{Error, Result};
use crate::generate::{StopReason, StopStrings, TokenStream};
use crate::kv_cache::KvCache;
use crate::sampling::Sampler;
use std::time::Instant;
use tokenizers::Tokenizer;
use tokio::sync::mpsc::UnboundedSender;

pub struct Sequence<'t> {
    /// The prompt, then every sampled token. The cache holds all of it but the last sampled
    /// token (the next one to feed) once the prompt is in; `cache.len()` is how far it got.
    pub history: Vec<u32>,
    pub prompt_len: usize,
    /// One of the scheduler's caches, reset when this sequence took it.
    pub cache: KvCache,
    max_tokens: usize,
    ignore_eos: bool,
    sampler: Sampler,
    tokenizer: &'t Tokenizer,
    stream: TokenStream<'t>,
    stops: StopStrings,
    stop_list: Vec<String>,
    events: UnboundedSender<Event>,
    /// Set when the sequence ended; the scheduler then takes it out of the batch.
    pub outcome: Option<Outcome>,
    started: Instant,
}

/// How a sequence ended.
pub enum Outcome {
    Finished(StopReason),
    /// Decoding its text failed: a 500 for this request alone.
    Failed(String),
}

impl<'t> Sequence<'t> {
    pub fn new(job: Job, mut cache: KvCache, tokenizer: &'t Tokenizer) -> Self {
        cache.reset();
        let last = job.prompt.len().saturating_sub(1);
        Self {
            stream: TokenStream::new(tokenizer, &job.prompt[last..]),
            prompt_len: job.prompt.len(),
            history: job.prompt,
            cache,
            max_tokens: job.max_tokens,
            ignore_eos: job.ignore_eos,
            sampler: job.sampler,
            tokenizer,
            stops: StopStrings::new(&job.stop),
            stop_list: job.stop,
            events: job.events,
            outcome: None,
            started: Instant::now(),
        }
    }

    /// Whether the client went away (its receiver dropped: a closed connection).
    pub fn abandoned(&self) -> bool {
        self.events.is_closed()
    }

    /// The ids to feed this step, at most `budget` of them while the prompt goes in (one
    /// decode token after that); `None` when the budget leaves none for this prompt.
    pub fn pending(&self, budget: usize) -> Option<std::ops::Range<usize>> {
        let start = self.cache.len();
        let n = match start < self.prompt_len {
            true => (self.prompt_len - start).min(budget),
            false => self.history.len() - start,
        };
        (n > 0).then(|| start..start + n)
    }

    /// Whether part of the prompt is not in the cache yet.
    pub fn prefilling(&self) -> bool {
        self.cache.len() < self.prompt_len
    }

    fn generated(&self) -> &[u32] {
        &self.history[self.prompt_len..]
    }

    /// Samples the next token from the logits of the last fed position and streams its text;
    /// sets [`outcome`](Self::outcome) when the sequence ended.
    pub fn advance(&mut self, logits: &[f32], eos: &[u32]) {
        self.outcome = match self.next_token(logits, eos) {
            Ok(None) => None,
            Ok(Some(reason)) => Some(Outcome::Finished(reason)),
            Err(e) => Some(Outcome::Failed(e.to_string())),
        };
    }

    fn next_token(&mut self, logits: &[f32], eos: &[u32]) -> Result<Option<StopReason>> {
        let next = self.sampler.sample(logits, &self.history);
        if !self.ignore_eos && eos.contains(&next) {
            return Ok(Some(StopReason::Eos));
        }
        self.history.push(next);
        if let Some(text) = self.stream.push(next)? {
            let (shown, stopped) = self.stops.push(&text);
            self.send_text(shown);
            if stopped {
                return Ok(Some(StopReason::Stop));
            }
        }
        if self.generated().len() == self.max_tokens {
            return Ok(Some(StopReason::Length));
        }
        // The request was checked to fit, so this is only a guard.
        if self.cache.len() == self.cache.capacity() {
            return Ok(Some(StopReason::Context));
        }
        Ok(None)
    }

    fn send_text(&self, text: String) {
        if !text.is_empty() {
            // A closed receiver is noticed at the next step.
            let _ = self.events.send(Event::Text(text));
        }
    }

    /// Sends the end of the request (the final reply, or its error); returns the cache for
    /// reuse. A sequence that has not ended lost its client, or the shutdown cancelled it.
    pub fn end(mut self) -> KvCache {
        match self.outcome.take() {
            Some(Outcome::Finished(reason)) => self.finish(reason),
            Some(Outcome::Failed(m)) => self.fail(&m),
            None if self.abandoned() => {
                eprintln!(
                    "request: the client went away after {} prompt + {} completion tokens: \
                     dropped, its cache is free",
                    self.cache.len().min(self.prompt_len),
                    self.generated().len()
                );
                self.cache
            }
            None => {
                let _ = self.events.send(Event::Cancelled);
                self.cache
            }
        }
    }

    fn finish(mut self, reason: StopReason) -> KvCache {
        match self.final_text(reason) {
            Ok(text) => {
                let finish = Finish {
                    reason,
                    text,
                    prompt_tokens: self.prompt_len,
                    completion_tokens: self.generated().len(),
                };
                eprintln!(
                    "request: {} prompt + {} completion tokens ({}) in {:.2} s",
                    finish.prompt_tokens,
                    finish.completion_tokens,
                    reason.as_str(),
                    self.started.elapsed().as_secs_f64()
                );
                let _ = self.events.send(Event::Done(finish));
            }
            Err(e) => {
                let _ = self.events.send(Event::Failed(e.to_string()));
            }
        }
        self.cache
    }

    /// Streams the held-back text, and returns the whole text as `generate` reports it: the
    /// generated ids decoded at once, cut at the first stop string.
    fn final_text(&mut self, reason: StopReason) -> Result<String> {
        if reason != StopReason::Stop {
            let rest = self.stream.flush()?;
            let rest = rest.map(|t| self.stops.push(&t).0).unwrap_or_default();
            let rest = rest + &self.stops.finish();
            self.send_text(rest);
        }
        let mut text = self
            .tokenizer
            .decode(self.generated(), true)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        if let Some(at) = crate::generate::first_match(&text, &self.stop_list) {
            text.truncate(at);
        }
        Ok(text)
    }

    /// Ends the request with an error (500 before a stream starts, an error event in one);
    /// returns the cache for reuse.
    pub fn fail(self, message: &str) -> KvCache {
        let _ = self.events.send(Event::Failed(message.to_string()));
        self.cache
    }
}
