//! The HTTP side: routes, the API key, and a request made into a scheduler [`Job`]: parse
//! (400), check the model (404), tokenize (chat through the model's template), resolve the
//! sampling as `generate` does, check that it fits the context (400), queue it (429 when
//! full), then reply whole or as a stream.

use super::chat;
use super::checks;
use super::error::{ApiError, SHUTDOWN, STOPPED};
use super::metrics::Gauges;
use super::openai::{CompletionRequest, Params, Prompt, Reply};
use super::queue::{Queue, Refused, Stats};
use super::request::{Event, Job};
use super::sse;
use super::structured;
use super::tools::ToolCalls;
use crate::chat::ChatTemplate;
use crate::config::GenerationConfig;
use crate::grammar::Grammars;
use crate::loader::TextTokenizer;
use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::{header, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// What every handler reads; the model itself lives in the scheduler thread.
pub struct Served {
    /// The id `/v1/models` lists and requests may name.
    pub model_id: String,
    /// When the server started (Unix seconds), for `/v1/models`.
    pub created: u64,
    pub tokenizer: TextTokenizer,
    pub template: Option<ChatTemplate>,
    pub generation: GenerationConfig,
    pub vocab_size: usize,
    /// The model's EOS ids, for structured output's grammars.
    pub eos: Vec<u32>,
    /// Built at the first request with a `response_format` (or the reason they cannot be).
    pub grammars: OnceLock<Result<Grammars, String>>,
    /// Tokens one request may hold, prompt and completion: the caches' capacity.
    pub context: usize,
    pub max_batch: usize,
    pub queue: Queue,
    pub stats: Arc<Stats>,
    pub api_key: Option<String>,
    /// How long a request may wait for a cache (`--request-timeout`).
    pub request_timeout: Duration,
}

pub(super) type Shared = Arc<Served>;
pub(super) type Answer = Result<Response, ApiError>;

pub fn router(served: Shared) -> Router {
    let v1 = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat::completions))
        .route("/apply-template", post(chat::apply_template))
        .route_layer(middleware::from_fn_with_state(served.clone(), auth));
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .merge(v1)
        .fallback(not_found)
        .with_state(served)
}

pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn health(State(s): State<Shared>) -> (StatusCode, Json<Value>) {
    let st = &s.stats;
    let alive = st.alive.load(Ordering::Acquire);
    let body = Json(
        json!({"status": if alive { "ok" } else { "scheduler stopped" },
                "max_batch": s.max_batch,
                "running": st.running.load(Ordering::Relaxed),
                "waiting": st.waiting.load(Ordering::Relaxed),
                "preempted": st.preempted.load(Ordering::Relaxed),
                "kv_blocks_free": st.blocks_free.load(Ordering::Relaxed)
                    + st.blocks_cached.load(Ordering::Relaxed),
                "largest_batch": st.largest_batch.load(Ordering::Relaxed),
                "scheduler_restarts": st.restarts.load(Ordering::Relaxed)}),
    );
    let status = match alive {
        true => StatusCode::OK,
        false => StatusCode::SERVICE_UNAVAILABLE,
    };
    (status, body)
}

/// Prometheus' text format; like `/health`, open without the API key (as vLLM's).
async fn metrics(State(s): State<Shared>) -> Response {
    let st = &s.stats;
    let gauges = Gauges {
        running: st.running.load(Ordering::Relaxed),
        waiting: st.waiting.load(Ordering::Relaxed),
        preempted: st.preempted.load(Ordering::Relaxed),
        blocks_used: st.blocks_used.load(Ordering::Relaxed),
        blocks_cached: st.blocks_cached.load(Ordering::Relaxed),
        blocks_free: st.blocks_free.load(Ordering::Relaxed),
        cache_bytes: st.cache_bytes.load(Ordering::Relaxed),
    };
    let body = st.metrics.render(&gauges);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}

fn model_object(s: &Served) -> Value {
    json!({"id": s.model_id, "object": "model", "created": s.created,
           "owned_by": "tiny-decoder", "context_length": s.context})
}

async fn models(State(s): State<Shared>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_object(&s)]}))
}

async fn model(State(s): State<Shared>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    match id == s.model_id {
        true => Ok(Json(model_object(&s))),
        false => Err(ApiError::model_not_found(&id, &s.model_id)),
    }
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::not_found(uri.path())
}

/// With `--api-key`, `/v1/*` needs `Authorization: Bearer KEY`; `/health` never does.
async fn auth(State(s): State<Shared>, req: Request, next: Next) -> Response {
    if let Some(key) = &s.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if !given.is_some_and(|g| same(g.trim().as_bytes(), key.as_bytes())) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

/// Compares in time that does not depend on where the strings differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The body as JSON, whatever its content type (curl's `-d` says form data).
pub(super) fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))
}

pub(super) fn check_model(s: &Served, p: &Params) -> Result<(), ApiError> {
    match &p.model {
        Some(m) if *m != s.model_id => Err(ApiError::model_not_found(m, &s.model_id)),
        _ => Ok(()),
    }
}

async fn completions(State(s): State<Shared>, body: Bytes) -> Answer {
    let req: CompletionRequest = parse(&body)?;
    check_model(&s, &req.params)?;
    let logprobs = checks::completion_logprobs(req.logprobs)?;
    let encode = |text: &str| {
        let text = text.to_string();
        off_workers(&s, move |s| {
            s.tokenizer
                .encode(&text)
                .map_err(|e| ApiError::bad_field("prompt", e.to_string()))
        })
    };
    let prompt = match &req.prompt {
        Prompt::Text(t) => encode(t).await?,
        Prompt::Texts(t) if t.len() == 1 => encode(&t[0]).await?,
        Prompt::Texts(t) => {
            let m = format!(
                "{} prompts in one request: send one prompt per request",
                t.len()
            );
            return Err(ApiError::bad_field("prompt", m));
        }
        Prompt::Ids(ids) => ids.clone(),
    };
    let ask = Ask {
        chat: false,
        logprobs,
        tools: None,
    };
    respond(&s, prompt, &req.params, ask).await
}

/// Runs `work` (templating, tokenizing: CPU-bound for a long prompt) on tokio's blocking
/// threads, so that the two async workers stay free for `/health` and cheap refusals.
pub(super) async fn off_workers<T: Send + 'static>(
    s: &Shared,
    work: impl FnOnce(&Served) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let s = s.clone();
    tokio::task::spawn_blocking(move || work(&s))
        .await
        .unwrap_or_else(|_| Err(ApiError::internal("preparing the request failed (a bug)")))
}

/// Queues the request and replies: the whole text, or a stream of it.
/// What a request asks for beyond its `Params`.
pub(super) struct Ask {
    /// `/v1/chat/completions` rather than `/v1/completions`.
    pub chat: bool,
    pub logprobs: Option<usize>,
    /// Parse tool calls from the reply.
    pub tools: Option<ToolCalls>,
}

pub(super) async fn respond(s: &Shared, prompt: Vec<u32>, p: &Params, ask: Ask) -> Answer {
    // Ids sent as such, or a tokenizer's added tokens past the model's embedding rows: an
    // id the model has no row for fails this request, not the batch step it would join.
    if let Some(id) = prompt.iter().find(|&&id| id as usize >= s.vocab_size) {
        let m = format!(
            "token id {id} is not below the model's vocabulary size {}",
            s.vocab_size
        );
        return Err(ApiError::bad_field("prompt", m));
    }
    let (max_tokens, sampler) = p.check(&prompt, s.context, &s.generation)?;
    let constraint = structured::constraint(s, p).await?;
    let (events, receiver) = unbounded_channel();
    let job = Job {
        prompt,
        max_tokens,
        stop: p.stops(),
        ignore_eos: p.ignore_eos.unwrap_or(false),
        cache_prompt: p.cache_prompt.unwrap_or(true),
        logprobs: ask.logprobs,
        constraint,
        sampler,
        events,
        queued: Instant::now(),
    };
    s.queue.submit(job).map_err(|r| match r {
        Refused::Full => ApiError::busy(s.queue.capacity),
        Refused::Stopped => ApiError::unavailable(SHUTDOWN),
    })?;
    // The status goes out once the request has a cache: a 408, 503 or 500 before then.
    let receiver = admitted(receiver, s.request_timeout).await?;
    let prefix = if ask.chat { "chatcmpl" } else { "cmpl" };
    let reply = Reply {
        id: format!("{prefix}-{:016x}", rand::random::<u64>()),
        created: unix_now(),
        model: s.model_id.clone(),
        chat: ask.chat,
        tools: ask.tools,
    };
    match p.stream() {
        true => Ok(sse::response(
            reply,
            receiver,
            p.include_usage(),
            s.request_timeout,
        )),
        false => whole(reply, receiver, s.request_timeout).await,
    }
}

/// Waits until the scheduler admits the request; its refusal as the error to answer.
async fn admitted(
    mut events: UnboundedReceiver<Event>,
    timeout: Duration,
) -> Result<UnboundedReceiver<Event>, ApiError> {
    match events.recv().await {
        Some(Event::Admitted) => Ok(events),
        Some(event) => Err(ApiError::ending(event, timeout)),
        None => Err(ApiError::internal(STOPPED)),
    }
}

async fn whole(reply: Reply, mut events: UnboundedReceiver<Event>, timeout: Duration) -> Answer {
    while let Some(event) = events.recv().await {
        match event {
            Event::Admitted | Event::Text(_) => {}
            Event::Done(f) => return Ok(Json(reply.whole(&f)).into_response()),
            event => return Err(ApiError::ending(event, timeout)),
        }
    }
    Err(ApiError::internal(STOPPED))
}
