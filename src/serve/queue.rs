//! The queue between the HTTP handlers and the scheduler: a request is queued without
//! waiting, at most `--max-queue` of them (one more is refused, and answered 429), and the
//! counters `/health` reports.

use super::metrics::Metrics;
use super::request::Job;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;

/// What the scheduler reports on `/health`.
#[derive(Debug)]
pub struct Stats {
    /// Requests in the batch after the last step.
    pub running: AtomicUsize,
    /// Requests queued to be admitted (what `--max-queue` bounds).
    pub waiting: AtomicUsize,
    /// The most requests one step has fed since start: above 1, requests were batched.
    pub largest_batch: AtomicUsize,
    /// Panics the scheduler survived (each failed the requests in flight).
    pub restarts: AtomicUsize,
    /// False once the scheduler thread has ended: `/health` then answers 503.
    pub alive: AtomicBool,
    /// Requests preempted for blocks, waiting to resume.
    pub preempted: AtomicUsize,
    /// The pool's blocks after the last turn: in a running request's cache, cached (a
    /// prefix kept for later requests), free; and the pool's bytes.
    pub blocks_used: AtomicUsize,
    pub blocks_cached: AtomicUsize,
    pub blocks_free: AtomicUsize,
    pub cache_bytes: AtomicUsize,
    /// What `/metrics` reports besides the above.
    pub metrics: Metrics,
}

impl Default for Stats {
    fn default() -> Self {
        Self {
            running: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            largest_batch: AtomicUsize::new(0),
            restarts: AtomicUsize::new(0),
            alive: AtomicBool::new(true),
            preempted: AtomicUsize::new(0),
            blocks_used: AtomicUsize::new(0),
            blocks_cached: AtomicUsize::new(0),
            blocks_free: AtomicUsize::new(0),
            cache_bytes: AtomicUsize::new(0),
            metrics: Metrics::default(),
        }
    }
}

/// The sending end of the queue of waiting requests, held by the HTTP handlers.
#[derive(Clone)]
pub struct Queue {
    pub(super) jobs: Sender<Job>,
    pub(super) stats: Arc<Stats>,
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
    /// Whether a request would be refused as [`Refused::Full`] now (checked before costly
    /// preparation; [`Queue::submit`] decides).
    pub fn full(&self) -> bool {
        self.stats.waiting.load(Ordering::Acquire) >= self.capacity
    }

    /// Queues `job` without waiting.
    pub fn submit(&self, job: Job) -> std::result::Result<(), Refused> {
        let waiting = &self.stats.waiting;
        let room = |n: usize| (n < self.capacity).then_some(n + 1);
        let metrics = &self.stats.metrics;
        if waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, room)
            .is_err()
        {
            metrics.rejected.fetch_add(1, Ordering::Relaxed);
            return Err(Refused::Full);
        }
        self.jobs.send(job).map_err(|_| {
            waiting.fetch_sub(1, Ordering::AcqRel);
            Refused::Stopped
        })?;
        metrics.received.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}
