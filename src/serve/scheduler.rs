//! The scheduler: one thread owns the model and the `--max-batch` KV caches, and runs
//! continuous batching. Each step feeds every running sequence at once through
//! [`Transformer::next_logits_batch`]: one decode token for each sequence that generates, a
//! chunk of the prompt for each newcomer. Requests wait in a bounded queue and join at the
//! next step that finds a cache free; a sequence leaves when it ends (EOS id, stop string,
//! `max_tokens`, the context) or its client goes away, and its cache goes back to the free
//! list. The caches are allocated once, at start-up, and only reset between requests.

use super::sequence::Sequence;
use crate::error::Result;
use crate::generate::StopReason;
use crate::kv_cache::KvCache;
use crate::model::{Feed, Transformer};
use crate::sampling::Sampler;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use tokenizers::Tokenizer;
use tokio::sync::mpsc::UnboundedSender;

/// Prompt tokens fed per step, all newcomers together. Every running stream waits for a
/// step that carries a prompt chunk, so a long prompt goes in over several steps: 128 tokens
/// keep that pause short (SmolLM2-135M prefills about 300 tok/s on two CPU cores: 0.4 s)
/// while a chunk is still wide enough for the tiled products to run at prefill speed.
pub const PREFILL_PER_STEP: usize = 128;

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
    pub sampler: Sampler,
    /// Where the request's text and end go; dropped by the handler when its client leaves.
    pub events: UnboundedSender<Event>,
}

/// What the scheduler tells a request's handler.
pub enum Event {
    /// Text that became complete (none of it part of a stop string).
    Text(String),
    /// The end, with the whole text and the counts.
    Done(Finish),
    /// The request failed: its step did (a 500).
    Failed(String),
    /// The server's shutdown ended the request before it was done (a 503).
    Cancelled,
}

#[derive(Debug, Clone)]
pub struct Finish {
    pub reason: StopReason,
    /// The generated ids decoded at once, cut at the first stop string (as `generate`).
    pub text: String,
    pub prompt_tokens: usize,
    /// Tokens generated, the EOS id excluded.
    pub completion_tokens: usize,
}

/// What the scheduler reports on `/health`.
#[derive(Debug, Default)]
pub struct Stats {
    /// Sequences in the batch after the last step.
    pub running: AtomicUsize,
    /// The most sequences one step has fed since start: above 1, requests were batched.
    pub largest_batch: AtomicUsize,
}

/// The sending end of the queue of waiting requests, held by the HTTP handlers.
#[derive(Clone)]
pub struct Queue {
    jobs: SyncSender<Job>,
    /// How many requests may wait (`--max-queue`).
    pub capacity: usize,
}

/// Why a request was not queued.
pub enum Refused {
    /// `capacity` requests are already waiting.
    Full,
    /// The scheduler has stopped.
    Stopped,
}

impl Queue {
    /// Queues `job` without waiting.
    pub fn submit(&self, job: Job) -> std::result::Result<(), Refused> {
        self.jobs.try_send(job).map_err(|e| match e {
            TrySendError::Full(_) => Refused::Full,
            TrySendError::Disconnected(_) => Refused::Stopped,
        })
    }
}

/// Starts the scheduler thread with `caches` (one per sequence that may run at once). It
/// ends when every [`Queue`] is dropped and its running sequences are done; `cancel` ends
/// them at the next step instead.
pub fn spawn(
    model: Transformer,
    tokenizer: Arc<Tokenizer>,
    caches: Vec<KvCache>,
    max_queue: usize,
    cancel: Arc<AtomicBool>,
    stats: Arc<Stats>,
) -> std::io::Result<(Queue, JoinHandle<()>)> {
    let (jobs, waiting) = sync_channel(max_queue);
    let thread = std::thread::Builder::new()
        .name("scheduler".into())
        .spawn(move || run(&model, &tokenizer, caches, &waiting, &cancel, &stats))?;
    let queue = Queue {
        jobs,
        capacity: max_queue,
    };
    Ok((queue, thread))
}

fn run(
    model: &Transformer,
    tokenizer: &Tokenizer,
    mut free: Vec<KvCache>,
    waiting: &Receiver<Job>,
    cancel: &AtomicBool,
    stats: &Stats,
) {
    let eos = model.config().eos_token_ids.clone();
    let mut running: Vec<Sequence> = Vec::with_capacity(free.len());
    loop {
        // 1. Join: waiting requests take free caches; with nothing running, wait for one.
        while let Some(cache) = free.pop() {
            let job = match running.is_empty() {
                true => waiting.recv().ok(),
                false => waiting.try_recv().ok(),
            };
            match job {
                Some(job) => running.push(Sequence::new(job, cache, tokenizer)),
                None => {
                    free.push(cache);
                    break;
                }
            }
        }
        if running.is_empty() {
            return; // every sender is gone: the server has shut down
        }
        // 2. Leave: clients that went away, or everyone once the shutdown cancels.
        let cancelled = cancel.load(Ordering::Relaxed);
        for seq in running.extract_if(.., |s| cancelled || s.abandoned()) {
            free.push(seq.end());
        }
        if running.is_empty() {
            stats.running.store(0, Ordering::Relaxed);
            continue; // a step needs at least one sequence
        }
        // 3. One step. A model error or a panic fails this step's requests, not the server.
        let stepped = catch_unwind(AssertUnwindSafe(|| step(model, &mut running, &eos, stats)));
        let failure = match stepped {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(format!("the model step failed: {e}")),
            Err(_) => Some("internal error in the model step (see the server's log)".into()),
        };
        if let Some(message) = failure {
            for seq in running.drain(..) {
                free.push(seq.fail(&message));
            }
        }
        // 4. Leave: sequences that ended.
        for seq in running.extract_if(.., |s| s.outcome.is_some()) {
            free.push(seq.end());
        }
        stats.running.store(running.len(), Ordering::Relaxed);
    }
}

/// Feeds every running sequence (a decode token, or the next chunk of its prompt within
/// [`PREFILL_PER_STEP`]) in one batched forward, then samples a token for each whose prompt
/// is now all in its cache.
fn step(model: &Transformer, running: &mut [Sequence], eos: &[u32], stats: &Stats) -> Result<()> {
    let mut budget = PREFILL_PER_STEP;
    let mut fed = Vec::with_capacity(running.len());
    let mut feeds = Vec::with_capacity(running.len());
    for (i, seq) in running.iter_mut().enumerate() {
        let Some(range) = seq.pending(budget) else {
            continue;
        };
        if seq.prefilling() {
            budget -= range.len();
        }
        fed.push(i);
        feeds.push(Feed {
            ids: &seq.history[range],
            cache: &mut seq.cache,
        });
    }
    stats
        .largest_batch
        .fetch_max(feeds.len(), Ordering::Relaxed);
    let logits = model.next_logits_batch(&mut feeds)?;
    for (i, logits) in fed.into_iter().zip(logits) {
        let seq = &mut running[i];
        // A prompt fed only in part: its last position's logits predict nothing yet.
        if !seq.prefilling() {
            seq.advance(&logits, eos);
        }
    }
    Ok(())
}
