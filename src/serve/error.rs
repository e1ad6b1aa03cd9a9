//! OpenAI's error reply: a status and the body its clients read,
//! `{"error": {"message", "type", "param", "code"}}`, one constructor per way a request
//! fails.

use super::request::Event;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::time::Duration;

/// The message of a request the shutdown cancelled.
pub const SHUTDOWN: &str = "the server is shutting down";
/// The message of a request whose scheduler went away without ending it (a bug).
pub const STOPPED: &str = "the scheduler stopped before this request ended";

/// An error reply: its status, and the body OpenAI's clients read.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, ...
    pub kind: &'static str,
    /// The request field at fault, if one is.
    pub param: Option<&'static str>,
    /// A machine-readable reason: `model_not_found`, `context_length_exceeded`, ...
    pub code: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: String) -> Self {
        Self {
            status,
            message,
            kind,
            param: None,
            code: None,
        }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// 400: malformed JSON, a bad field, a prompt that does not fit.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            message.into(),
        )
    }

    /// 400 naming the field at fault (`param`).
    pub fn bad_field(param: &'static str, message: impl Into<String>) -> Self {
        let mut e = Self::bad_request(message);
        e.param = Some(param);
        e
    }

    pub fn unauthorized() -> Self {
        let m = "missing or wrong API key: send the header `Authorization: Bearer KEY` with the \
                 key the server was started with (--api-key or TINY_DECODER_API_KEY)";
        Self::new(StatusCode::UNAUTHORIZED, "authentication_error", m.into())
            .with_code("invalid_api_key")
    }

    pub fn model_not_found(asked: &str, served: &str) -> Self {
        let m = format!("the model {asked:?} does not exist: this server serves {served:?}");
        let mut e = Self::new(StatusCode::NOT_FOUND, "invalid_request_error", m);
        e.param = Some("model");
        e.with_code("model_not_found")
    }

    pub fn not_found(path: &str) -> Self {
        let m = format!("no route {path}: see /v1/models, /v1/completions, /v1/chat/completions");
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", m)
    }

    /// 429: the queue of waiting requests is full.
    pub fn busy(max_queue: usize) -> Self {
        let m = format!(
            "the server is busy: {max_queue} requests are already waiting (--max-queue); retry later"
        );
        Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", m).with_code("queue_full")
    }

    /// 500: the model step failed for this request.
    pub fn internal(message: impl Into<String>) -> Self {
        let status = StatusCode::INTERNAL_SERVER_ERROR;
        Self::new(status, "server_error", message.into())
    }

    /// 503: the server is shutting down.
    pub fn unavailable(message: impl Into<String>) -> Self {
        let status = StatusCode::SERVICE_UNAVAILABLE;
        Self::new(status, "server_error", message.into())
    }

    /// 408: the request waited longer than `--request-timeout` for a cache.
    pub fn timed_out(timeout: Duration) -> Self {
        let m = format!(
            "the request waited more than {} s for the model (--request-timeout): the server \
             is overloaded; retry later",
            timeout.as_secs_f64()
        );
        Self::new(StatusCode::REQUEST_TIMEOUT, "timeout_error", m).with_code("request_timeout")
    }

    /// 408: the request's body did not arrive within `--body-timeout`.
    pub fn body_timed_out(timeout: Duration) -> Self {
        let m = format!(
            "the request body did not arrive within {} s (--body-timeout)",
            timeout.as_secs_f64()
        );
        Self::new(StatusCode::REQUEST_TIMEOUT, "timeout_error", m).with_code("body_timeout")
    }

    /// 413: the body is over the server's limit.
    pub fn too_large(limit: usize) -> Self {
        let m = format!("the request body is over {limit} bytes");
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", m)
    }

    /// The error for an event that ends a request without a reply.
    pub fn ending(event: Event, timeout: Duration) -> Self {
        match event {
            Event::Failed(m) => Self::internal(m),
            Event::Cancelled => Self::unavailable(SHUTDOWN),
            Event::TimedOut => Self::timed_out(timeout),
            Event::Admitted | Event::Text(_) | Event::Done(_) => {
                Self::internal("the scheduler answered out of order (a bug)")
            }
        }
    }

    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param,
                         "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}
