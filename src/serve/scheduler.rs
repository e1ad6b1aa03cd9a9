//! The scheduler: one thread owns the model and the `--max-batch` KV caches, and runs
//! continuous batching. Each step feeds every running request at once through
//! [`Transformer::next_logits_batch`]: one decode token for each request that generates, a
//! chunk of the prompt for each newcomer. Requests wait in a bounded queue and join at the
//! next step that finds a cache free; one that waits past `--request-timeout` is answered
//! 408 and dropped. A request leaves when its sequence ends or its client goes away, and its
//! cache goes back to the free list. The caches are allocated once, at start-up, and only
//! reset between requests.
//!
//! A panic anywhere in the loop (inside a step or not) fails the requests in flight with a
//! 500 and the loop goes on with a fresh batch; if failing them panics too, the process
//! exits with status 70 for a supervisor to restart it. The server never answers 503
//! forever. `queue` holds the sending end; `fault` injects panics for the tests.

use super::fault;
use super::metrics::Ended;
use super::queue::{Queue, Stats};
use super::request::{Event, Job, Request};
use super::slots::{common_prefix, Slots};
use crate::error::Result;
use crate::kv_cache::KvCache;
use crate::model::{Feed, Transformer};
use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;
use tokenizers::Tokenizer;

/// Prompt tokens fed per step, all newcomers together. Every running stream waits for a
/// step that carries a prompt chunk, so a long prompt goes in over several steps: 128 tokens
/// keep that pause short (SmolLM2-135M prefills about 300 tok/s on two CPU cores: 0.4 s)
/// while a chunk is still wide enough for the tiled products to run at prefill speed.
pub const PREFILL_PER_STEP: usize = 128;

/// How the scheduler runs besides its model and caches.
pub struct Settings {
    /// Requests that may wait for a cache (`--max-queue`).
    pub max_queue: usize,
    /// How long a request may wait for a cache before it is answered 408.
    pub request_timeout: Duration,
    /// Set by the second shutdown signal: every request ends at the next step.
    pub cancel: Arc<AtomicBool>,
    pub stats: Arc<Stats>,
}

/// Starts the scheduler thread with `caches` (one per request that may run at once). It
/// ends when every [`Queue`] is dropped and its running requests are done.
pub fn spawn(
    model: Transformer,
    tokenizer: Arc<Tokenizer>,
    caches: Vec<KvCache>,
    settings: Settings,
) -> std::io::Result<(Queue, JoinHandle<()>)> {
    let (jobs, inbox) = channel();
    let queue = Queue {
        jobs,
        stats: settings.stats.clone(),
        capacity: settings.max_queue,
    };
    let thread = std::thread::Builder::new()
        .name("scheduler".into())
        .spawn(move || {
            let stats = settings.stats.clone();
            let run = || supervise(&model, &tokenizer, caches, &inbox, &settings);
            if catch_unwind(AssertUnwindSafe(run)).is_err() {
                // The loop could not recover (a panic while failing requests): exit so that
                // a supervisor restarts the server, rather than answer 503 from now on.
                eprintln!("error: the scheduler cannot go on (the panic above); exiting");
                std::process::exit(70);
            }
            stats.alive.store(false, Ordering::Release);
        })?;
    Ok((queue, thread))
}

/// The requests the scheduler holds: those that run (each in its cache), the free caches,
/// and those that wait for one. Kept outside each turn so that a panic loses none of them.
struct Batch<'t> {
    running: Vec<Request<'t>>,
    free: Slots,
    waiting: VecDeque<Job>,
    /// Caches the pool holds in all (`--max-batch`), each of `context` positions.
    slots: usize,
    context: usize,
}

/// Whether the scheduler goes on after a turn.
enum Flow {
    Continue,
    Stop,
}

/// Runs turns until the queue is closed and drained; a turn that panics fails the requests
/// in flight and the next turn starts with a whole pool of caches.
fn supervise(
    model: &Transformer,
    tokenizer: &Tokenizer,
    caches: Vec<KvCache>,
    inbox: &Receiver<Job>,
    settings: &Settings,
) {
    let mut batch = Batch {
        running: Vec::with_capacity(caches.len()),
        slots: caches.len(),
        context: caches.first().map_or(0, KvCache::capacity),
        free: Slots::default(),
        waiting: VecDeque::new(),
    };
    for cache in caches {
        batch.free.give_back(cache, None);
    }
    let mut fault = fault::Injector::from_env();
    loop {
        let turn = catch_unwind(AssertUnwindSafe(|| {
            turn(model, tokenizer, &mut batch, inbox, settings, &mut fault)
        }));
        match turn {
            Ok(Flow::Continue) => {}
            Ok(Flow::Stop) => return,
            Err(_) => {
                fault.at(fault::Point::Recover);
                let n = batch.recover(model);
                let restarts = settings.stats.restarts.fetch_add(1, Ordering::Relaxed) + 1;
                eprintln!(
                    "scheduler: internal error (the panic above): {n} running requests failed \
                     with 500; scheduler restarted ({restarts} restarts so far)"
                );
            }
        }
    }
}

/// The message of the requests a scheduler panic ended.
const PANICKED: &str = "internal error in the scheduler (see the server's log)";

impl Batch<'_> {
    /// After a panic: fails the running requests, and refills the pool with fresh caches for
    /// any that were lost with a request the panic dropped. Returns the requests failed.
    fn recover(&mut self, model: &Transformer) -> usize {
        let failed = self.running.len();
        for req in self.running.drain(..) {
            req.fail(PANICKED, &mut self.free);
        }
        let (cfg, dtype, device) = (model.config(), model.dtype(), model.device());
        while self.free.len() < self.slots {
            match KvCache::new(cfg, self.context, dtype, device) {
                Ok(cache) => self.free.give_back(cache, None),
                Err(e) => {
                    eprintln!("scheduler: cannot replace a lost cache: {e}");
                    break;
                }
            }
        }
        failed
    }
}

/// One turn: take in new requests, drop those that waited too long or lost their client,
/// admit what fits, run one step, let ended requests leave.
fn turn<'t>(
    model: &Transformer,
    tokenizer: &'t Tokenizer,
    b: &mut Batch<'t>,
    inbox: &Receiver<Job>,
    s: &Settings,
    fault: &mut fault::Injector,
) -> Flow {
    let waiting = &s.stats.waiting;
    // 1. Take in: with nothing to do, wait for a request; the queue closed means shutdown.
    if b.running.is_empty() && b.waiting.is_empty() {
        match inbox.recv() {
            Ok(job) => b.waiting.push_back(job),
            Err(_) => return Flow::Stop,
        }
    }
    b.waiting.extend(inbox.try_iter());
    // 2. Waiting requests that lost their client, waited too long, or meet the shutdown.
    let cancelled = s.cancel.load(Ordering::Relaxed);
    let metrics = &s.stats.metrics;
    b.waiting.retain(|job| {
        let (reply, ended) = if cancelled {
            (Event::Cancelled, Ended::Cancelled)
        } else if job.abandoned() {
            metrics.finished(Ended::Abandoned);
            return false_after(waiting);
        } else if job.queued.elapsed() > s.request_timeout {
            (Event::TimedOut, Ended::TimedOut)
        } else {
            return true;
        };
        metrics.finished(ended);
        let _ = job.events.send(reply);
        false_after(waiting)
    });
    // 3. Join: waiting requests take free caches, first come first served, each the one
    // holding the longest prefix of its prompt. One whose prefix a running request is still
    // prefilling keeps its place until then (to copy it), and the ones behind it go ahead.
    let mut next = 0;
    while !b.free.is_empty() && next < b.waiting.len() {
        let job = &b.waiting[next];
        if job.cache_prompt && prefix_on_its_way(&b.running, &job.prompt, &b.free) {
            next += 1;
            continue;
        }
        let Some(job) = b.waiting.remove(next) else {
            break;
        };
        let reuse = if job.cache_prompt {
            &job.prompt[..]
        } else {
            &[]
        };
        let Some(mut cache) = b.free.take(reuse) else {
            b.waiting.insert(next, job);
            break;
        };
        copy_running_prefix(&b.running, reuse, &mut cache);
        waiting.fetch_sub(1, Ordering::AcqRel);
        match Request::start(job, cache, model, tokenizer, s.stats.clone()) {
            Ok(req) => b.running.push(req),
            Err(cache) => {
                s.stats.metrics.finished(Ended::Error);
                b.free.give_back(cache, None);
            }
        }
        fault.at(fault::Point::Admit);
    }
    // 4. Leave: clients that went away, or everyone once the shutdown cancels.
    for req in b.running.extract_if(.., |r| cancelled || r.abandoned()) {
        req.end(&mut b.free);
    }
    if b.running.is_empty() {
        s.stats.running.store(0, Ordering::Relaxed);
        s.stats.caches_free.store(b.free.len(), Ordering::Relaxed);
        return Flow::Continue; // a step needs at least one request
    }
    // 5. One step. A model error fails this step's requests, not the server.
    if let Err(e) = step(model, &mut b.running, &s.stats, fault) {
        let message = format!("the model step failed: {e}");
        for req in b.running.drain(..) {
            req.fail(&message, &mut b.free);
        }
    }
    // 6. Leave: requests that ended.
    for req in b.running.extract_if(.., |r| r.done()) {
        req.end(&mut b.free);
    }
    s.stats.running.store(b.running.len(), Ordering::Relaxed);
    s.stats.caches_free.store(b.free.len(), Ordering::Relaxed);
    Flow::Continue
}

/// Fewest more tokens a running request must share with a prompt than its free cache does
/// for the shared prefix to be copied from it (a copy is a memcpy of the positions' K/V,
/// far cheaper than prefilling them, but not free).
const COPY_MIN_TOKENS: usize = 32;

/// When a running request has cached a longer prefix of `prompt` than `cache` holds (many
/// requests with one system prompt, arriving together), copies that prefix into `cache`.
fn copy_running_prefix(running: &[Request], prompt: &[u32], cache: &mut KvCache) {
    let shared = |r: &&Request| {
        let held = &r.seq.history()[..r.seq.cache().len()];
        let n = common_prefix(held, prompt);
        // The prompt's last token is always fed (its logits start the reply).
        n.min(prompt.len().saturating_sub(1)).min(cache.capacity())
    };
    let Some(from) = running.iter().max_by_key(shared) else {
        return;
    };
    let n = shared(&from);
    if n >= cache.len() + COPY_MIN_TOKENS {
        if let Err(e) = cache.copy_prefix(from.seq.cache(), n) {
            eprintln!("scheduler: prefix copy failed, prefilling instead: {e}");
            cache.reset();
        }
    }
}

/// Whether a running request is prefilling a prompt that shares at least
/// [`COPY_MIN_TOKENS`] more with `prompt` than any free cache holds: waiting for it to
/// finish, then copying, beats prefilling the same tokens twice at once.
fn prefix_on_its_way(running: &[Request], prompt: &[u32], free: &Slots) -> bool {
    let have = free.longest_prefix(prompt);
    running.iter().filter(|r| r.seq.prefilling()).any(|r| {
        let n = common_prefix(r.seq.history(), prompt);
        n.min(prompt.len().saturating_sub(1)) >= have.max(r.seq.cache().len()) + COPY_MIN_TOKENS
    })
}

/// Counts a request out of the queue; `false`, for `retain`, to drop it.
fn false_after(waiting: &AtomicUsize) -> bool {
    waiting.fetch_sub(1, Ordering::AcqRel);
    false
}

/// Feeds every running request (a decode token, or the next chunk of its prompt within
/// [`PREFILL_PER_STEP`]) in one batched forward, then lets each take its logits.
fn step(
    model: &Transformer,
    running: &mut [Request],
    stats: &Stats,
    fault: &mut fault::Injector,
) -> Result<()> {
    let mut budget = PREFILL_PER_STEP;
    let mut fed = Vec::with_capacity(running.len());
    let mut feeds: Vec<Feed> = Vec::with_capacity(running.len());
    for (i, req) in running.iter_mut().enumerate() {
        let prefilling = req.seq.prefilling();
        let Some(feed) = req.seq.feed(budget) else {
            continue;
        };
        if prefilling {
            budget -= feed.ids.len();
        }
        fed.push(i);
        feeds.push(feed);
    }
    stats
        .largest_batch
        .fetch_max(feeds.len(), Ordering::Relaxed);
    fault.at(fault::Point::Step);
    let logits = model.next_logits_batch(&mut feeds)?;
    for (i, logits) in fed.into_iter().zip(logits) {
        running[i].accept(&logits);
    }
    Ok(())
}
