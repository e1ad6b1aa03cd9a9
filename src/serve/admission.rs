//! Which requests run at the next step: admission by the KV pool's free blocks (preempted
//! requests first, then the queue, first come first served) and, before a step, preemption
//! of the requests admitted last when the step needs more blocks than are free.

use super::fault;
use super::metrics::Ended;
use super::queue::Stats;
use super::request::Request;
use super::scheduler::{feed_sizes, Batch, Settings};
use crate::kv_cache::{KvCache, KvPool, BLOCK};
use crate::model::Transformer;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use tokenizers::Tokenizer;

/// Admits preempted, then waiting requests while fewer than `--max-batch` run and the pool
/// has the blocks their prompts need. One whose prefix a running request is still prefilling
/// keeps its place until that prefix is cached, and the ones behind it go ahead.
pub(super) fn admit<'t>(
    model: &Transformer,
    tokenizer: &'t Tokenizer,
    b: &mut Batch<'t>,
    s: &Settings,
    fault: &mut fault::Injector,
) {
    while b.running.len() < s.max_batch {
        let Some(mut req) = b.preempted.pop_front() else {
            break;
        };
        let ids = req.seq.history().to_vec();
        if !take_prefix(&b.pool, req.seq.cache_mut(), &ids, true, b.running.len()) {
            b.preempted.push_front(req);
            return; // the oldest preempted request goes first
        }
        b.running.push(req);
    }
    let mut next = 0;
    while b.running.len() < s.max_batch && next < b.waiting.len() {
        let job = &b.waiting[next];
        if job.cache_prompt && prefix_on_its_way(&b.running, &job.prompt, &b.pool) {
            next += 1;
            continue;
        }
        let mut cache = b.pool.sequence(s.context);
        // A prompt past the context is refused by `Request::start`, with no blocks.
        let fits = job.prompt.len() <= s.context;
        if fits
            && !take_prefix(
                &b.pool,
                &mut cache,
                &job.prompt,
                job.cache_prompt,
                b.running.len(),
            )
        {
            break; // first come, first served: it waits for blocks, and those behind it
        }
        let Some(job) = b.waiting.remove(next) else {
            break;
        };
        s.stats.waiting.fetch_sub(1, Ordering::AcqRel);
        match Request::start(job, cache, model, tokenizer, s.stats.clone()) {
            Ok(req) => b.running.push(req),
            Err(_) => s.stats.metrics.finished(Ended::Error),
        }
        fault.at(fault::Point::Admit);
    }
}

/// Whether the blocks for `ids` are free (one kept per running request), counting those of
/// the longest prefix the pool holds when `reuse`: then the empty `cache` takes that prefix
/// (the last token is always fed: its logits start the reply). Otherwise `cache` stays empty.
fn take_prefix(
    pool: &KvPool,
    cache: &mut KvCache,
    ids: &[u32],
    reuse: bool,
    running: usize,
) -> bool {
    if reuse {
        cache.reuse_prefix(ids, ids.len().saturating_sub(1));
    }
    let rest = ids.len() - cache.len().min(ids.len());
    if cache.blocks_needed(rest) + running <= pool.available() {
        return true;
    }
    cache.reset();
    // With nothing running the pool holds any one request (at least one --context): it
    // starts from nothing rather than wait for a block that only its own reuse would take.
    running == 0 && ids.len().div_ceil(BLOCK) <= pool.available()
}

/// Fewest more tokens a running request must share with a prompt than the pool holds for it
/// to be worth waiting for that request to cache them.
const WAIT_MIN_TOKENS: usize = 32;

/// Whether a running request is prefilling a prompt that shares at least
/// [`WAIT_MIN_TOKENS`] more with `prompt` than the pool holds: waiting for its blocks beats
/// prefilling the same tokens twice at once.
fn prefix_on_its_way(running: &[Request], prompt: &[u32], pool: &KvPool) -> bool {
    let have = pool.cached(prompt, prompt.len().saturating_sub(1));
    running.iter().filter(|r| r.seq.prefilling()).any(|r| {
        let n = crate::kv_cache::common_prefix(r.seq.history(), prompt);
        n.min(prompt.len().saturating_sub(1)) >= have.max(r.seq.cache().len()) + WAIT_MIN_TOKENS
    })
}

/// Before a step: while the running requests need more blocks than the pool has free,
/// preempts the one admitted last (never the only one: the pool holds at least one whole
/// `--context`). Its blocks go back; it resumes first, recomputing what it had.
pub(super) fn make_room<'t>(
    running: &mut Vec<Request<'t>>,
    preempted: &mut VecDeque<Request<'t>>,
    pool: &KvPool,
    stats: &Stats,
) {
    loop {
        let need: usize = (running.iter().zip(feed_sizes(running)))
            .map(|(r, n)| r.seq.cache().blocks_needed(n))
            .sum();
        if need <= pool.available() || running.len() <= 1 {
            return;
        }
        let Some(mut req) = running.pop() else {
            return;
        };
        req.seq.cache_mut().release();
        stats.metrics.preempted.fetch_add(1, Ordering::Relaxed);
        preempted.push_front(req);
    }
}
