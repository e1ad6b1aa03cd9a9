//! The scheduler: one thread owns the model and the KV pool, and runs continuous batching.
//! Each step feeds every running request at once through
//! [`Transformer::next_logits_batch`]: one decode token for each request that generates, a
//! chunk of the prompt for each newcomer. Requests wait in a bounded queue; one that waits
//! past `--request-timeout` is answered 408 and dropped.
//!
//! Memory is the pool's blocks ([`KvPool`], `--kv-memory`), not a cache per request: a
//! request is admitted, up to `--max-batch` at once, when the blocks its prompt needs are
//! free, less one per running request to grow by; it starts from the longest prefix of its
//! prompt that the pool holds (another request's system prompt in whole blocks, the turn
//! before of a conversation to its last token), shared, not copied. When a step needs more
//! blocks than are free, the requests admitted last are preempted: their blocks go back (and
//! stay cached) and they resume first, when blocks are free again, recomputing what they
//! had (vLLM's preemption by recompute; `admission`). A request that ends gives its blocks back; those of its
//! prompt and reply stay indexed for the next turn until a newer need evicts them.
//!
//! A panic anywhere in the loop (inside a step or not) fails the requests in flight with a
//! 500 and the loop goes on with a fresh batch; if failing them panics too, the process
//! exits with status 70 for a supervisor to restart it. The server never answers 503
//! forever. `queue` holds the sending end; `fault` injects panics for the tests.

use super::admission::{admit, make_room};
use super::fault;
use super::metrics::Ended;
use super::queue::{Queue, Stats};
use super::request::{Event, Job, Request};
use crate::error::Result;
use crate::kv_cache::KvPool;
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

/// How the scheduler runs besides its model and pool.
pub struct Settings {
    /// Requests that run at once (`--max-batch`).
    pub max_batch: usize,
    /// Tokens per request, prompt and completion (`--context`).
    pub context: usize,
    /// Requests that may wait (`--max-queue`).
    pub max_queue: usize,
    /// How long a request may wait to be admitted before it is answered 408.
    pub request_timeout: Duration,
    /// Set by the second shutdown signal: every request ends at the next step.
    pub cancel: Arc<AtomicBool>,
    pub stats: Arc<Stats>,
}

/// Starts the scheduler thread over `pool`. It ends when every [`Queue`] is dropped and its
/// running requests are done.
pub fn spawn(
    model: Transformer,
    tokenizer: Arc<Tokenizer>,
    pool: KvPool,
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
            let run = || supervise(&model, &tokenizer, pool, &inbox, &settings);
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

/// The requests the scheduler holds: those that run, in the order they were admitted, those
/// preempted (to resume first), and those that wait. Kept outside each turn so that a panic
/// loses none of them.
pub(super) struct Batch<'t> {
    pub(super) running: Vec<Request<'t>>,
    pub(super) preempted: VecDeque<Request<'t>>,
    pub(super) waiting: VecDeque<Job>,
    pub(super) pool: KvPool,
}

/// Whether the scheduler goes on after a turn.
enum Flow {
    Continue,
    Stop,
}

/// Runs turns until the queue is closed and drained; a turn that panics fails the requests
/// in flight, whose blocks go back to the pool.
fn supervise(
    model: &Transformer,
    tokenizer: &Tokenizer,
    pool: KvPool,
    inbox: &Receiver<Job>,
    settings: &Settings,
) {
    let mut batch = Batch {
        running: Vec::with_capacity(settings.max_batch),
        preempted: VecDeque::new(),
        waiting: VecDeque::new(),
        pool,
    };
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
                let n = batch.recover();
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
    /// After a panic: fails the running and preempted requests (their blocks go back with
    /// their caches). Returns the requests failed.
    fn recover(&mut self) -> usize {
        let failed = self.running.len() + self.preempted.len();
        for req in self.running.drain(..).chain(self.preempted.drain(..)) {
            req.fail(PANICKED);
        }
        failed
    }

    /// Stores the gauges `/health` and `/metrics` read.
    fn report(&self, stats: &Stats) {
        let usage = self.pool.usage();
        stats.running.store(self.running.len(), Ordering::Relaxed);
        stats
            .preempted
            .store(self.preempted.len(), Ordering::Relaxed);
        stats.blocks_used.store(usage.held, Ordering::Relaxed);
        stats.blocks_cached.store(usage.cached, Ordering::Relaxed);
        stats.blocks_free.store(usage.free, Ordering::Relaxed);
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
    if b.running.is_empty() && b.preempted.is_empty() && b.waiting.is_empty() {
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
    // 3. Leave: clients that went away, or everyone once the shutdown cancels.
    for req in b.running.extract_if(.., |r| cancelled || r.abandoned()) {
        req.end();
    }
    let (gone, kept) = (b.preempted.drain(..)).partition(|r| cancelled || r.abandoned());
    b.preempted = kept;
    gone.into_iter().for_each(Request::end);
    // 4. Join: preempted requests first, then waiting ones, first come first served.
    admit(model, tokenizer, b, s, fault);
    if b.running.is_empty() {
        b.report(&s.stats);
        return Flow::Continue; // a step needs at least one request
    }
    // 5. One step. A model error fails this step's requests, not the server.
    make_room(&mut b.running, &mut b.preempted, &b.pool, &s.stats);
    if let Err(e) = step(model, &mut b.running, &s.stats, fault) {
        let message = format!("the model step failed: {e}");
        for req in b.running.drain(..) {
            req.fail(&message);
        }
    }
    // 6. Leave: requests that ended.
    for req in b.running.extract_if(.., |r| r.done()) {
        req.end();
    }
    b.report(&s.stats);
    Flow::Continue
}

/// Counts a request out of the queue; `false`, for `retain`, to drop it.
fn false_after(waiting: &AtomicUsize) -> bool {
    waiting.fetch_sub(1, Ordering::AcqRel);
    false
}

/// How many ids each running request feeds at the next step: its decode token, or the next
/// chunk of its prompt (or of what it recomputes) within [`PREFILL_PER_STEP`] in all, first
/// admitted first.
pub(super) fn feed_sizes(running: &[Request]) -> Vec<usize> {
    let mut budget = PREFILL_PER_STEP;
    (running.iter())
        .map(|r| {
            let n = r.seq.next_feed(budget);
            if r.seq.prefilling() {
                budget -= n;
            }
            n
        })
        .collect()
}

/// Feeds every running request (a decode token, or the next chunk of its prompt within
/// [`PREFILL_PER_STEP`]) in one batched forward, then lets each take its logits.
fn step(
    model: &Transformer,
    running: &mut [Request],
    stats: &Stats,
    fault: &mut fault::Injector,
) -> Result<()> {
    let sizes = feed_sizes(running);
    let mut fed = Vec::with_capacity(running.len());
    let mut feeds: Vec<Feed> = Vec::with_capacity(running.len());
    for (i, (req, n)) in running.iter_mut().zip(sizes).enumerate() {
        let Some(feed) = req.seq.feed(n) else {
            continue;
        };
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
