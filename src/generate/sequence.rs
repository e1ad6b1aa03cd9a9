//! One sequence being generated ([`Sequence`]) and the loop that runs one or many of them
//! through the model's batched step together ([`run`]). `generate`, `chat` and the server's
//! scheduler all drive this one type: sample, EOS, stop strings, stream, length and context
//! are decided here and nowhere else.

use super::{stop, Generation, Options, StopReason, StopStrings, TokenStream};
use crate::error::{Error, Result};
use crate::grammar::Constraint;
use crate::kv_cache::KvCache;
use crate::model::{Feed, Transformer};
use crate::sampling::{Sampler, TokenLogprob};
use std::borrow::BorrowMut;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;
use tokenizers::Tokenizer;

/// Runs `seqs` to their ends together: each step feeds every unfinished sequence (its prompt
/// first, then its last token) through one [`Transformer::next_logits_batch`], so the
/// weights are read once per step for all of them. `on_text(i, piece)` streams sequence i's
/// text. `interrupt`, checked after every step, ends them all as `Interrupted`.
pub fn run<C: BorrowMut<KvCache>, S: BorrowMut<Sampler>>(
    model: &Transformer,
    seqs: &mut [Sequence<'_, C, S>],
    interrupt: Option<&AtomicBool>,
    mut on_text: impl FnMut(usize, &str),
) -> Result<()> {
    loop {
        let start = Instant::now();
        let mut feeds: Vec<Feed> = seqs.iter_mut().filter_map(|s| s.feed(usize::MAX)).collect();
        if feeds.is_empty() {
            return Ok(());
        }
        let logits = model.next_logits_batch(&mut feeds)?;
        drop(feeds);
        let interrupted = interrupt.is_some_and(|i| i.load(Ordering::Relaxed));
        let running = seqs.iter_mut().enumerate().filter(|(_, s)| !s.ended());
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
/// and stop strings. The cache and the sampler are borrowed (`generate`, `chat`: the caller
/// keeps them for the next turn) or owned (the server's scheduler: a request owns one of its
/// caches while it runs), whichever `C` and `S` are.
pub struct Sequence<'a, C = &'a mut KvCache, S = &'a mut Sampler> {
    tokenizer: &'a Tokenizer,
    /// Its first `cache.len()` positions hold `history[..cache.len()]`.
    cache: C,
    sampler: S,
    max_new_tokens: usize,
    /// Generate past the model's EOS ids, up to `max_new_tokens`.
    ignore_eos: bool,
    /// Alternatives to keep with each token's log-probability; `None`: keep none.
    top_logprobs: Option<usize>,
    /// One per generated token while `top_logprobs` is set.
    logprobs: Vec<TokenLogprob>,
    /// The grammar the output must match (structured output); `None`: free text.
    constraint: Option<Constraint>,
    eos: Vec<u32>,
    /// Text that ends the sequence (never shown, nor anything after it).
    stop_list: Vec<String>,
    /// The prompt, then every sampled token (the repeat penalty's window). Once the prompt
    /// is in, the cache holds all of it but the last sampled token (the next one to feed).
    history: Vec<u32>,
    prompt_len: usize,
    /// Leading prompt tokens the cache already held when the sequence began.
    reused: usize,
    stream: TokenStream<'a>,
    stops: StopStrings,
    stop: Option<StopReason>,
    /// Whether the last [`Sequence::feed`] carried prompt tokens (for [`Sequence::spend`]).
    fed_prompt: bool,
    prefill_secs: f64,
    decode_steps: usize,
    decode_secs: f64,
}

/// Checks that a prompt of `prompt_len` tokens leaves room for a token in a cache of
/// `capacity` positions and in the model's context.
pub fn check_fits(model: &Transformer, capacity: usize, prompt_len: usize) -> Result<()> {
    let context = model.config().max_position_embeddings;
    if prompt_len == 0 {
        return Err(Error::Invalid("the prompt encodes to no tokens".into()));
    }
    if prompt_len >= context.min(capacity + 1) {
        return Err(Error::Invalid(format!(
            "the prompt is {prompt_len} tokens but the context length is {}: shorten the prompt",
            context.min(capacity)
        )));
    }
    Ok(())
}

impl<'a, C: BorrowMut<KvCache>, S: BorrowMut<Sampler>> Sequence<'a, C, S> {
    /// Checks that the prompt fits `cache` and keeps the prefix the cache already holds: the
    /// caller guarantees its first `cache.len()` positions are `prompt_ids[..cache.len()]`
    /// (a chat turn's shared history; a reset cache holds none).
    pub fn new(
        model: &Transformer,
        tokenizer: &'a Tokenizer,
        cache: C,
        prompt_ids: &[u32],
        opts: Options<'_>,
        sampler: S,
    ) -> Result<Self> {
        check_fits(model, cache.borrow().capacity(), prompt_ids.len())?;
        Ok(Self::start(
            model, tokenizer, cache, prompt_ids, opts, sampler,
        ))
    }

    /// [`Sequence::new`] for a caller that has checked [`check_fits`] itself and must keep
    /// the cache whatever happens (the scheduler). A prompt that does not fit fails at its
    /// first step instead (an empty one is never fed).
    pub fn start(
        model: &Transformer,
        tokenizer: &'a Tokenizer,
        mut cache: C,
        prompt_ids: &[u32],
        opts: Options<'_>,
        sampler: S,
    ) -> Self {
        let reused = cache.borrow().len().min(prompt_ids.len().saturating_sub(1));
        cache.borrow_mut().truncate(reused);
        let last = prompt_ids.len().saturating_sub(1);
        Self {
            tokenizer,
            cache,
            sampler,
            max_new_tokens: opts.max_new_tokens,
            ignore_eos: opts.ignore_eos,
            top_logprobs: opts.logprobs,
            logprobs: Vec::new(),
            constraint: None,
            eos: model.config().eos_token_ids.clone(),
            stop_list: opts
                .stop
                .iter()
                .filter(|s| !s.is_empty())
                .cloned()
                .collect(),
            history: prompt_ids.to_vec(),
            prompt_len: prompt_ids.len(),
            reused,
            stream: TokenStream::new(tokenizer, &prompt_ids[last..]),
            stops: StopStrings::new(opts.stop),
            stop: None,
            fed_prompt: false,
            prefill_secs: 0.0,
            decode_steps: 0,
            decode_secs: 0.0,
        }
    }

    /// The ids to feed this step with the cache they go into: at most `budget` prompt tokens
    /// while the prompt goes in (a long prompt in chunks), then the last sampled token.
    /// `None` once the sequence ended, or when `budget` leaves no prompt token for it.
    pub fn feed(&mut self, budget: usize) -> Option<Feed<'_>> {
        let start = self.cache.borrow().len();
        self.fed_prompt = self.prefilling();
        let n = self.next_feed(budget);
        (n > 0).then(|| Feed {
            ids: &self.history[start..start + n],
            cache: self.cache.borrow_mut(),
        })
    }

    /// How many ids [`Sequence::feed`] would feed with `budget`.
    pub fn next_feed(&self, budget: usize) -> usize {
        let start = self.cache.borrow().len();
        match (self.stop, self.prefilling()) {
            (Some(_), _) => 0,
            (None, true) => (self.history.len() - start).min(budget),
            (None, false) => self.history.len() - start,
        }
    }

    /// Whether more than the last sampled token is missing from the cache: part of the
    /// prompt, or, after the scheduler took the cache's blocks back (preemption), the
    /// tokens to recompute.
    pub fn prefilling(&self) -> bool {
        let held = self.cache.borrow().len();
        held + 1 < self.history.len() || held < self.prompt_len
    }

    /// Takes the logits of the step that fed [`Sequence::feed`]: samples the next token and
    /// either queues it for the next step or ends the sequence. After a prompt chunk that
    /// left part of the prompt out, the logits predict nothing yet and are ignored.
    pub fn accept(&mut self, logits: &[f32], on_text: &mut dyn FnMut(&str)) -> Result<()> {
        if self.cache.borrow().len() < self.history.len() {
            return Ok(()); // a chunk that predicts a token sampled already, or none yet
        }
        if self.generated().len() == self.max_new_tokens {
            return self.end(StopReason::Length, on_text);
        }
        // A grammar masks what it does not allow next; the sampler and the log-probabilities
        // see the masked logits, the distribution the token is drawn from.
        let masked;
        let logits = match &mut self.constraint {
            Some(c) => {
                let mut l = logits.to_vec();
                c.mask(&mut l)?;
                masked = l;
                &masked[..]
            }
            None => logits,
        };
        let next = self.sampler.borrow_mut().sample(logits, &self.history);
        if let Some(c) = &mut self.constraint {
            c.accept(next)?;
        }
        if !self.ignore_eos && self.eos.contains(&next) {
            return self.end(StopReason::Eos, on_text);
        }
        if let Some(top) = self.top_logprobs {
            let sampler = self.sampler.borrow();
            let scored = sampler.logprobs(logits, &self.history, next, top);
            self.logprobs.push(scored);
        }
        self.history.push(next);
        if let Some(text) = self.stream.push(next)? {
            let (shown, stopped) = self.stops.push(&text);
            on_text(&shown);
            if stopped {
                self.stop = Some(StopReason::Stop);
                return Ok(());
            }
        }
        if self.constraint.as_ref().is_some_and(Constraint::complete) {
            // The grammar allows nothing more: the output is whole, as at an EOS.
            return self.end(StopReason::Eos, on_text);
        }
        if self.generated().len() == self.max_new_tokens {
            return self.end(StopReason::Length, on_text);
        }
        let cache = self.cache.borrow();
        if cache.len() == cache.capacity() {
            self.end(StopReason::Context, on_text)?;
        }
        Ok(())
    }

    /// Ends the sequence, emitting the text still held back.
    pub fn end(&mut self, reason: StopReason, on_text: &mut dyn FnMut(&str)) -> Result<()> {
        self.stop = Some(reason);
        let rest = self.stream.flush()?.map(|t| self.stops.push(&t).0);
        on_text(&(rest.unwrap_or_default() + &self.stops.finish()));
        Ok(())
    }

    /// Whether the sequence has ended.
    pub fn ended(&self) -> bool {
        self.stop.is_some()
    }

    /// The ids generated so far, the EOS id excluded.
    pub fn generated(&self) -> &[u32] {
        &self.history[self.prompt_len..]
    }

    /// Each generated token's log-probability (with the options' `logprobs`), in order.
    pub fn logprobs(&self) -> &[TokenLogprob] {
        &self.logprobs
    }

    /// Makes the rest of the output match `constraint`'s grammar.
    pub fn constrain(&mut self, constraint: Constraint) {
        self.constraint = Some(constraint);
    }

    /// Whether the options asked for log-probabilities.
    pub fn reports_logprobs(&self) -> bool {
        self.top_logprobs.is_some()
    }

    /// The prompt and the tokens sampled so far; the cache holds the first `cache.len()`.
    pub fn history(&self) -> &[u32] {
        &self.history
    }

    /// Leading prompt tokens the cache held when the sequence began (not prefilled).
    pub fn reused(&self) -> usize {
        self.reused
    }

    pub fn prompt_len(&self) -> usize {
        self.prompt_len
    }

    /// Counts a step's time: as prefill while it fed prompt tokens, else as one decode step.
    pub fn spend(&mut self, secs: f64) {
        match self.fed_prompt {
            true => self.prefill_secs += secs,
            false => {
                self.decode_steps += 1;
                self.decode_secs += secs;
            }
        }
    }

    /// The result so far (at the end: the result): the generated ids decoded at once, cut
    /// at the first stop string.
    pub fn generation(&self) -> Result<Generation> {
        let mut text = self
            .tokenizer
            .decode(self.generated(), true)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        if let Some(at) = stop::first_match(&text, &self.stop_list) {
            text.truncate(at);
        }
        let cache = self.cache.borrow();
        Ok(Generation {
            prompt_token_ids: self.history[..self.prompt_len].to_vec(),
            reused_tokens: self.reused,
            token_ids: self.generated().to_vec(),
            text,
            stop_reason: self.stop.unwrap_or(StopReason::Interrupted),
            prefill_secs: self.prefill_secs,
            decode_steps: self.decode_steps,
            decode_secs: self.decode_secs,
            kv_cache_bytes: cache.bytes_in_use(),
            kv_bytes_per_token: cache.bytes_per_token(),
        })
    }

    /// The result, once [`run`] has ended the sequence.
    pub fn finish(self) -> Result<Generation> {
        self.generation()
    }

    /// The cache: its first `len()` positions hold `history()[..len()]`.
    pub fn cache(&self) -> &KvCache {
        self.cache.borrow()
    }

    /// The cache, for the scheduler to take its blocks back (the sequence then recomputes
    /// what it held at its next feeds) or give it a cached prefix of [`Sequence::history`].
    pub fn cache_mut(&mut self) -> &mut KvCache {
        self.cache.borrow_mut()
    }
}
