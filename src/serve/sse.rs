//! A streamed reply as server-sent events in OpenAI's chunk format: `data: {chunk}\n\n` for
//! each piece of text, a last chunk with the finish reason (then one with `usage` when the
//! request asked), and `data: [DONE]`. Dropping the stream (the client closed the connection)
//! drops the request's receiver, which the scheduler notices at its next step.

use super::error::{ApiError, STOPPED};
use super::openai::{finish_reason, Reply};
use super::request::Event;
use axum::body::{Body, Bytes};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::response::{IntoResponse, Response};
use futures_core::Stream;
use serde_json::Value;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;
use tokio::sync::mpsc::UnboundedReceiver;

pub fn response(
    reply: Reply,
    events: UnboundedReceiver<Event>,
    include_usage: bool,
    timeout: Duration,
) -> Response {
    let chunks = Chunks {
        reply,
        events,
        include_usage,
        timeout,
        opened: false,
        ended: false,
        sent: 0,
    };
    let headers = [
        (CONTENT_TYPE, "text/event-stream"),
        (CACHE_CONTROL, "no-cache"),
    ];
    (headers, Body::from_stream(chunks)).into_response()
}

/// The events of one request, as the bytes of its stream.
struct Chunks {
    reply: Reply,
    events: UnboundedReceiver<Event>,
    include_usage: bool,
    /// `--request-timeout`, for the message of a request that timed out.
    timeout: Duration,
    /// Whether chat's opening chunk (the assistant's role) was sent.
    opened: bool,
    /// Whether `[DONE]` was sent.
    ended: bool,
    /// Characters of completion text sent (the completions' `text_offset`).
    sent: usize,
}

fn data(v: &Value) -> String {
    format!("data: {v}\n\n")
}

const DONE: &str = "data: [DONE]\n\n";

impl Chunks {
    /// The bytes for one event; the last ones end with `[DONE]`.
    fn bytes(&mut self, event: Option<Event>) -> String {
        let usage = self.include_usage;
        let end = match event {
            Some(Event::Text(p)) => {
                let text = Some((p.text.as_str(), p.logprobs.as_deref()));
                let chunk = self.reply.chunk(text, self.sent, None, usage);
                self.sent += p
                    .logprobs
                    .iter()
                    .flatten()
                    .map(|l| l.chosen.token.chars().count())
                    .sum::<usize>();
                return data(&chunk);
            }
            Some(Event::Done(f)) => {
                let reason = finish_reason(f.reason);
                let mut out = data(&self.reply.chunk(None, self.sent, Some(reason), usage));
                if usage {
                    out += &data(&self.reply.usage_chunk(&f));
                }
                out
            }
            // An error after the headers went out: OpenAI's clients raise it from the body.
            // Admission came before the stream; anything else ends it with its error.
            Some(Event::Admitted) => return String::new(),
            Some(e) => data(&ApiError::ending(e, self.timeout).body()),
            None => data(&ApiError::internal(STOPPED).body()),
        };
        self.ended = true;
        end + DONE
    }
}

impl Stream for Chunks {
    type Item = Result<Bytes, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        if this.reply.chat && !this.opened {
            this.opened = true;
            let opening = data(&this.reply.chunk(None, 0, None, this.include_usage));
            return Poll::Ready(Some(Ok(opening.into())));
        }
        let event = ready!(this.events.poll_recv(cx));
        Poll::Ready(Some(Ok(this.bytes(event).into())))
    }
}
