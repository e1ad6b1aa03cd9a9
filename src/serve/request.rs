//! One request: what a handler hands the scheduler ([`Job`]), what the scheduler tells the
//! handler back ([`Event`]), and the request while it runs ([`Request`]): a
//! [`generate::Sequence`] that owns its cache in the scheduler's pool, plus the channel its
//! text goes out on. The sequence decides when it ends, as in `generate`; this file only reports.

use super::logprobs::Logprobs;
use super::metrics::Ended;
use super::queue::Stats;
use crate::generate::{self, Options, StopReason};
use crate::grammar::Constraint;
use crate::kv_cache::KvCache;
use crate::model::Transformer;
use crate::sampling::Sampler;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use tokenizers::Tokenizer;
use tokio::sync::mpsc::UnboundedSender;

/// A request, tokenized and checked by its handler.
pub struct Job {
    /// Not empty; with `max_tokens` it fits the caches' capacity.
    pub prompt: Vec<u32>,
    /// At least 1.
    pub max_tokens: usize,
    /// Non-empty stop strings.
    pub stop: Vec<String>,
    /// Generate past the model's EOS ids, up to `max_tokens`.
    pub ignore_eos: bool,
    /// Start from the longest prefix of the prompt the pool holds (else from nothing).
    pub cache_prompt: bool,
    /// The grammar the reply must match (`response_format`).
    pub constraint: Option<Constraint>,
    /// Report each token's log-probability with this many alternatives (`logprobs`).
    pub logprobs: Option<usize>,
    pub sampler: Sampler,
    /// Where the request's text and end go; dropped by the handler when its client leaves.
    pub events: UnboundedSender<Event>,
    /// When the handler queued it: `--request-timeout` counts from here until it is admitted.
    pub queued: Instant,
}

impl Job {
    /// Whether the client went away (its receiver dropped: a closed connection).
    pub fn abandoned(&self) -> bool {
        self.events.is_closed()
    }
}

/// What the scheduler tells a request's handler.
pub enum Event {
    /// The request was admitted and joins the batch at the next step.
    Admitted,
    /// Text that became complete (none of it part of a stop string), and the
    /// log-probabilities of the tokens sampled since the last piece (when asked).
    Text(Piece),
    /// The end, with the whole text and the counts.
    Done(Finish),
    /// The request failed: its step did, or the scheduler (a 500).
    Failed(String),
    /// It waited longer than `--request-timeout` to be admitted (a 408).
    TimedOut,
    /// The server's shutdown ended the request before it was done (a 503).
    Cancelled,
}

/// What one step adds to a stream.
#[derive(Debug, Clone)]
pub struct Piece {
    pub text: String,
    pub logprobs: Option<Vec<Logprobs>>,
}

#[derive(Debug, Clone)]
pub struct Finish {
    pub reason: StopReason,
    /// The generated ids decoded at once, cut at the first stop string (as `generate`).
    pub text: String,
    pub prompt_tokens: usize,
    /// Tokens generated, the EOS id excluded.
    pub completion_tokens: usize,
    /// Leading prompt tokens that were in the cache already (not prefilled again).
    pub cached_tokens: usize,
    /// One per generated token, when the request asked.
    pub logprobs: Option<Vec<Logprobs>>,
}

/// A request while it runs in the scheduler.
pub struct Request<'t> {
    pub seq: generate::Sequence<'t, KvCache, Sampler>,
    events: UnboundedSender<Event>,
    tokenizer: &'t Tokenizer,
    /// Log-probabilities already sent in a [`Piece`].
    logprobs_sent: usize,
    /// Set when its text could not be decoded: a 500 for this request alone.
    failure: Option<String>,
    /// When it was queued and when it started, for the log and `/metrics`.
    queued: Instant,
    started: Instant,
    /// When its last token was sampled (`None` before the first).
    last_token: Option<Instant>,
    stats: Arc<Stats>,
}

impl<'t> Request<'t> {
    /// Starts `job` in `cache`, which holds a prefix of its prompt (or nothing); drops the
    /// cache when the prompt does not fit it (the handler checked, so this is a guard),
    /// having answered the request.
    pub fn start(
        job: Job,
        cache: KvCache,
        model: &Transformer,
        tokenizer: &'t Tokenizer,
        stats: Arc<Stats>,
    ) -> Result<Self, KvCache> {
        if let Err(e) = generate::check_fits(model, cache.capacity(), job.prompt.len()) {
            let _ = job.events.send(Event::Failed(e.to_string()));
            return Err(cache);
        }
        let opts = Options {
            max_new_tokens: job.max_tokens,
            stop: &job.stop,
            interrupt: None,
            ignore_eos: job.ignore_eos,
            logprobs: job.logprobs,
        };
        let mut seq =
            generate::Sequence::start(model, tokenizer, cache, &job.prompt, opts, job.sampler);
        if let Some(c) = job.constraint {
            seq.constrain(c);
        }
        let _ = job.events.send(Event::Admitted);
        Ok(Self {
            seq,
            events: job.events,
            tokenizer,
            logprobs_sent: 0,
            failure: None,
            queued: job.queued,
            started: Instant::now(),
            last_token: None,
            stats,
        })
    }

    /// Whether the client went away (its receiver dropped: a closed connection).
    pub fn abandoned(&self) -> bool {
        self.events.is_closed()
    }

    /// Whether it ended (or failed) and should leave the batch.
    pub fn done(&self) -> bool {
        self.seq.ended() || self.failure.is_some()
    }

    /// Takes the logits of the step that fed it: samples, streams, and maybe ends.
    pub fn accept(&mut self, logits: &[f32]) {
        let mut text = String::new();
        let before = self.seq.generated().len();
        if let Err(e) = self.seq.accept(logits, &mut |t: &str| text.push_str(t)) {
            self.failure = Some(e.to_string());
            return;
        }
        if self.seq.generated().len() > before {
            let (now, metrics) = (Instant::now(), &self.stats.metrics);
            match self.last_token {
                None => metrics.ttft.observe((now - self.queued).as_secs_f64()),
                Some(last) => metrics.per_token.observe((now - last).as_secs_f64()),
            }
            self.last_token = Some(now);
        }
        let logprobs = self.logprobs_from(self.logprobs_sent);
        self.logprobs_sent = self.seq.logprobs().len();
        if !text.is_empty() || logprobs.as_ref().is_some_and(|l| !l.is_empty()) {
            // A closed receiver is noticed at the next step.
            let _ = self.events.send(Event::Text(Piece { text, logprobs }));
        }
    }

    /// The log-probabilities of the generated tokens from `start` on, when asked for.
    fn logprobs_from(&self, start: usize) -> Option<Vec<Logprobs>> {
        let all = self.seq.logprobs();
        self.seq.reports_logprobs().then(|| {
            let new = all.get(start..).unwrap_or_default();
            new.iter()
                .map(|l| Logprobs::new(self.tokenizer, l))
                .collect()
        })
    }

    /// Sends the end of the request (the final reply, or its error); its cache's blocks go
    /// back to the pool, those it filled kept for a later prompt that begins with them. A
    /// request that has not ended lost its client, or the shutdown cancelled it.
    pub fn end(self) {
        if let Some(m) = &self.failure {
            let m = m.clone();
            return self.fail(&m);
        }
        if !self.seq.ended() {
            if self.abandoned() {
                self.count(Ended::Abandoned);
                eprintln!(
                    "request: the client went away after {} prompt + {} completion tokens: \
                     dropped, its blocks are free",
                    self.seq.prompt_len(),
                    self.seq.generated().len()
                );
            } else {
                self.count(Ended::Cancelled);
                let _ = self.events.send(Event::Cancelled);
            }
            return;
        }
        match self.seq.generation() {
            Ok(g) => {
                let finish = Finish {
                    reason: g.stop_reason,
                    text: g.text,
                    prompt_tokens: g.prompt_token_ids.len(),
                    completion_tokens: g.token_ids.len(),
                    cached_tokens: g.reused_tokens,
                    logprobs: self.logprobs_from(0),
                };
                eprintln!(
                    "request: {} prompt + {} completion tokens ({}) in {:.2} s",
                    finish.prompt_tokens,
                    finish.completion_tokens,
                    finish.reason.as_str(),
                    self.started.elapsed().as_secs_f64()
                );
                self.count(match finish.reason {
                    StopReason::Length | StopReason::Context => Ended::Length,
                    _ => Ended::Stop,
                });
                let _ = self.events.send(Event::Done(finish));
            }
            Err(e) => {
                self.count(Ended::Error);
                let _ = self.events.send(Event::Failed(e.to_string()));
            }
        }
    }

    /// Counts the request out in `/metrics`: how it ended, its tokens, its duration.
    fn count(&self, how: Ended) {
        let m = &self.stats.metrics;
        m.finished(how);
        let add =
            |c: &std::sync::atomic::AtomicU64, n: usize| c.fetch_add(n as u64, Ordering::Relaxed);
        add(&m.prompt_tokens, self.seq.prompt_len());
        add(&m.cached_tokens, self.seq.reused());
        add(&m.generation_tokens, self.seq.generated().len());
        m.request.observe(self.queued.elapsed().as_secs_f64());
    }

    /// Ends the request with an error (500 before a stream starts, an error event in one).
    /// Its blocks go back; only those a finished step filled are indexed, so a failed step
    /// leaves nothing another request could reuse.
    pub fn fail(self, message: &str) {
        self.count(Ended::Error);
        let _ = self.events.send(Event::Failed(message.to_string()));
    }
}
