//! `tiny-decoder serve`: an OpenAI-compatible HTTP server with continuous batching.
//!
//! `routes` checks requests and answers in OpenAI's shapes (`openai`), whole or streamed
//! as server-sent events (`sse`). One `scheduler` thread owns the model and the KV pool
//! (`--kv-memory`, allocated here once in blocks); every request runs as a `request` whose
//! cache takes the pool's blocks as it grows, batched with the others at each step. tokio
//! serves HTTP on two threads of its own; the model's products keep the cores (candle's
//! thread pool).

mod admission;
mod chat;
mod checks;
mod error;
mod fault;
mod http;
mod logprobs;
mod metrics;
mod openai;
mod queue;
mod request;
mod routes;
mod scheduler;
mod sse;
mod structured;
mod tools;

pub use http::Limits;
pub use scheduler::PREFILL_PER_STEP;

use crate::chat::ChatTemplate;
use crate::config::GenerationConfig;
use crate::error::{Error, Result};
use crate::kv_cache::{KvPool, BLOCK};
use crate::loader::TextTokenizer;
use crate::model::Transformer;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How the server runs (the `serve` flags).
#[derive(Debug, Clone)]
pub struct Options {
    /// The id `/v1/models` lists; a request's `model`, when given, must be it.
    pub model_id: String,
    pub host: String,
    /// 0 picks a free port (the address printed on stderr says which).
    pub port: u16,
    /// Sequences that run at once.
    pub max_batch: usize,
    /// Requests that may wait; one more is answered 429.
    pub max_queue: usize,
    /// Tokens per request, prompt and completion: each cache's capacity.
    pub context: usize,
    /// Bytes of the KV pool (at least one `context` worth).
    pub kv_memory: usize,
    /// Required as `Authorization: Bearer KEY` on `/v1/*` when set.
    pub api_key: Option<String>,
    /// How long a request may wait for a cache before it is answered 408.
    pub request_timeout: Duration,
    /// Connections, header and body timeouts, and the drain at shutdown.
    pub limits: Limits,
    /// Called once the KV pool is allocated and written (resident), before the first request
    /// is taken: the command line moves the process's memory into 2 MiB pages there, the
    /// pool's with the weights' (`cli/huge_pages.rs`).
    pub allocated: fn(),
}

/// The model and what goes with it.
pub struct Model {
    pub model: Transformer,
    pub tokenizer: TextTokenizer,
    /// `None`: `/v1/chat/completions` answers 400.
    pub template: Option<ChatTemplate>,
    pub generation: GenerationConfig,
}

/// Serves until SIGINT or SIGTERM, then lets running requests finish for at most
/// `--shutdown-timeout` (a second signal cancels them) and returns.
pub fn run(m: Model, opts: Options) -> Result<()> {
    if opts.max_batch == 0 || opts.max_queue == 0 {
        return Err(Error::Invalid(
            "--max-batch and --max-queue must be at least 1".into(),
        ));
    }
    let cfg = m.model.config().clone();
    let (dtype, device) = (m.model.cache_dtype(), m.model.device().clone());
    let pool = KvPool::new(&cfg, opts.kv_memory, dtype, &device)?;
    if pool.blocks() * BLOCK < opts.context {
        return Err(Error::Invalid(format!(
            "--kv-memory {} holds {} positions, fewer than one --context of {}: raise it, or \
             lower --context",
            opts.kv_memory,
            pool.blocks() * BLOCK,
            opts.context
        )));
    }
    (opts.allocated)();
    let bytes = pool.bytes();
    eprintln!(
        "serve: {} | up to {} sequences at once, {} tokens each (prompt + completion) | KV \
         pool: {bytes} bytes, {} blocks of {BLOCK} positions, allocated once | queue: {} \
         requests",
        opts.model_id,
        opts.max_batch,
        opts.context,
        pool.blocks(),
        opts.max_queue
    );
    // What a user gains from a smaller cache (`--attention`, `--kv-dtype`), in their units.
    let (size, gb) = (dtype.size_in_bytes(), 1_000_000_000);
    let (tokens, sequences) = cfg.kv_capacity(size, gb, 4096);
    eprintln!(
        "serve: KV cache in {}, {} bytes a token: 1 GB holds {tokens} tokens of context, or \
         {sequences} sequences of 4096",
        dtype.as_str(),
        cfg.kv_bytes_per_token(size)
    );
    let cancel = Arc::new(AtomicBool::new(false));
    let stats = Arc::new(queue::Stats::default());
    stats.blocks_free.store(pool.blocks(), Ordering::Relaxed);
    stats.cache_bytes.store(bytes, Ordering::Relaxed);
    let tokenizer = Arc::new(m.tokenizer.inner().clone());
    let settings = scheduler::Settings {
        max_batch: opts.max_batch,
        context: opts.context,
        max_queue: opts.max_queue,
        request_timeout: opts.request_timeout,
        cancel: cancel.clone(),
        stats: stats.clone(),
    };
    let (queue, scheduler) = scheduler::spawn(m.model, tokenizer, pool, settings)
        .map_err(|e| Error::Serve(format!("cannot start the scheduler thread: {e}")))?;
    let served = Arc::new(routes::Served {
        model_id: opts.model_id.clone(),
        created: routes::unix_now(),
        tokenizer: m.tokenizer,
        template: m.template,
        generation: m.generation,
        vocab_size: cfg.vocab_size,
        eos: cfg.eos_token_ids.clone(),
        grammars: std::sync::OnceLock::new(),
        context: opts.context,
        max_batch: opts.max_batch,
        queue,
        stats,
        api_key: opts.api_key.clone(),
        request_timeout: opts.request_timeout,
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::Serve(format!("cannot start the HTTP runtime: {e}")))?;
    let result = runtime.block_on(listen(routes::router(served), &opts, cancel));
    // The router, and with it the queue's sender, is gone: the scheduler ends its running
    // sequences (cancelled ones at once) and returns.
    drop(runtime);
    let _ = scheduler.join();
    result
}

async fn listen(app: axum::Router, opts: &Options, cancel: Arc<AtomicBool>) -> Result<()> {
    let (host, port) = (opts.host.as_str(), opts.port);
    let listener = tokio::net::TcpListener::bind((host, port))
        .await
        .map_err(|e| {
            let hint = "pick another --host or --port (0: any free port)";
            Error::Serve(format!("cannot listen on {host}:{port}: {e}: {hint}"))
        })?;
    let addr = listener
        .local_addr()
        .map_err(|e| Error::Serve(format!("cannot read the bound address: {e}")))?;
    let signals = http::signals();
    // Tests and scripts read this line for the port that `--port 0` picked.
    eprintln!("listening on http://{addr}");
    http::serve(listener, app, &opts.limits, cancel, signals).await
}
