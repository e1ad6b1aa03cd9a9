//! A streamed reply as server-sent events in OpenAI's chunk format: `data: {chunk}\n\n` for
//! each piece of text, a last chunk with the finish reason (then one with `usage` when the
//! request asked), and `data: [DONE]`. Dropping the stream (the client closed the connection)
//! drops the request's receiver, which the scheduler notices at its next step.

use super::error::{ApiError, STOPPED};
use super::openai::{finish_reason, Reply};
use super::request::Event;
use crate::chat::tools::ToolFormat;
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
        held: String::new(),
        released: 0,
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
    /// With tools: the reply so far, of which `released` bytes went out as content (the
    /// rest may be a tool call, sent as `tool_calls` at the end).
    held: String,
    released: usize,
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
                let text = match self.reply.tools.as_ref().map(|t| t.format) {
                    Some(format) => self.release(format, &p.text),
                    None => p.text,
                };
                if text.is_empty() && p.logprobs.is_none() {
                    return String::new();
                }
                let chunk =
                    self.reply
                        .chunk(Some((&text, p.logprobs.as_deref())), self.sent, None, usage);
                self.sent += p
                    .logprobs
                    .iter()
                    .flatten()
                    .map(|l| l.chosen.token.chars().count())
                    .sum::<usize>();
                return data(&chunk);
            }
            Some(Event::Done(f)) => {
                let mut reason = finish_reason(f.reason);
                let mut out = String::new();
                if let Some(tools) = &self.reply.tools {
                    let (content, calls) = tools.parse(&f.text);
                    // Not calls: the text held back is content. Calls: the content beyond
                    // what went out before them (text between and after Hermes calls).
                    let rest = match calls.is_empty() {
                        true => self.held[self.released..].to_string(),
                        false => {
                            let sent = self.held[..self.released].trim();
                            content
                                .strip_prefix(sent)
                                .unwrap_or("")
                                .trim_start()
                                .to_string()
                        }
                    };
                    if !rest.is_empty() {
                        let chunk = self
                            .reply
                            .chunk(Some((&rest, None)), self.sent, None, usage);
                        out += &data(&chunk);
                    }
                    if !calls.is_empty() {
                        out += &data(&self.reply.tool_calls_chunk(&calls));
                        reason = "tool_calls";
                    }
                }
                out += &data(&self.reply.chunk(None, self.sent, Some(reason), usage));
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

impl Chunks {
    /// Adds `text` to the reply so far and returns what may go out as content now: all
    /// but what may be a tool call (`ToolFormat::content_len`).
    fn release(&mut self, format: ToolFormat, text: &str) -> String {
        self.held.push_str(text);
        let upto = format.content_len(&self.held).max(self.released);
        let out = self.held[self.released..upto].to_string();
        self.released = upto;
        out
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::StopReason;
    use crate::serve::request::{Finish, Piece};
    use crate::serve::tools::ToolCalls;

    fn chunks(format: Option<ToolFormat>) -> Chunks {
        let tools = format.map(|format| ToolCalls {
            format,
            names: vec!["f".into()],
        });
        let (_, events) = tokio::sync::mpsc::unbounded_channel();
        let reply = Reply {
            id: "chatcmpl-1".into(),
            created: 0,
            model: "m".into(),
            chat: true,
            tools,
        };
        Chunks {
            reply,
            events,
            include_usage: false,
            timeout: Duration::from_secs(1),
            opened: true,
            ended: false,
            sent: 0,
            held: String::new(),
            released: 0,
        }
    }

    fn text(t: &str) -> Option<Event> {
        Some(Event::Text(Piece {
            text: t.into(),
            logprobs: None,
        }))
    }

    fn done(t: &str) -> Option<Event> {
        Some(Event::Done(Finish {
            reason: StopReason::Eos,
            text: t.into(),
            prompt_tokens: 3,
            completion_tokens: 9,
            cached_tokens: 0,
            logprobs: None,
        }))
    }

    /// The text of a stream's content deltas.
    fn content_of(events: &[Value]) -> String {
        events
            .iter()
            .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
            .collect()
    }

    /// The `data:` payloads of a stream's bytes, as JSON (`[DONE]` as a string).
    fn parse(bytes: &str) -> Vec<Value> {
        bytes
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .map(|d| serde_json::from_str(d).unwrap_or(Value::String(d.into())))
            .collect()
    }

    #[test]
    fn a_streamed_hermes_call_goes_out_as_tool_calls_and_text_before_it_as_content() {
        let mut c = chunks(Some(ToolFormat::Hermes));
        let call = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>";
        let mut out = String::new();
        for piece in ["Sure. <tool", &call[5..20], &call[20..]] {
            out += &c.bytes(text(piece));
        }
        out += &c.bytes(done(&format!("Sure. {call}")));
        let events = parse(&out);
        let content = content_of(&events);
        assert_eq!(content, "Sure. ");
        let calls = events
            .iter()
            .find_map(|e| e["choices"][0]["delta"]["tool_calls"].as_array())
            .expect("a tool_calls delta");
        assert_eq!(calls[0]["function"]["name"], "f");
        assert_eq!(calls[0]["function"]["arguments"], "{\"x\":1}");
        assert_eq!(calls[0]["index"], 0);
        let last = &events[events.len() - 2];
        assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(events.last(), Some(&Value::String("[DONE]".into())));

        // Text after the call goes out too, as in the whole reply's content.
        let mut c = chunks(Some(ToolFormat::Hermes));
        let reply = format!("{call}\nI will check.");
        let mut out = c.bytes(text(&reply));
        out += &c.bytes(done(&reply));
        let content = content_of(&parse(&out));
        assert_eq!(content, "I will check.");
        // A call to a function that was not offered is text.
        let mut c = chunks(Some(ToolFormat::Hermes));
        let other = call.replace("\"f\"", "\"rm_rf\"");
        let mut out = c.bytes(text(&other));
        out += &c.bytes(done(&other));
        let events = parse(&out);
        let content = content_of(&events);
        assert_eq!(content, other);
        assert_eq!(
            events[events.len() - 2]["choices"][0]["finish_reason"],
            "stop"
        );
    }

    #[test]
    fn a_reply_that_only_looked_like_a_call_is_sent_as_content() {
        let mut c = chunks(Some(ToolFormat::Llama3Json));
        let mut out = c.bytes(text("{not a call"));
        out += &c.bytes(text("}"));
        out += &c.bytes(done("{not a call}"));
        let events = parse(&out);
        let content = content_of(&events);
        assert_eq!(content, "{not a call}");
        let last = &events[events.len() - 2];
        assert_eq!(last["choices"][0]["finish_reason"], "stop");
        // Whole: the same, and a real call becomes message.tool_calls.
        let whole = c.reply.whole(&Finish {
            text: "{\"name\": \"f\", \"parameters\": {\"x\": 2}}".into(),
            ..match done("").unwrap() {
                Event::Done(f) => f,
                _ => unreachable!(),
            }
        });
        let choice = &whole["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls");
        assert_eq!(choice["message"]["content"], Value::Null);
        assert_eq!(
            choice["message"]["tool_calls"][0]["function"]["arguments"],
            "{\"x\":2}"
        );
        assert!(choice["message"]["tool_calls"][0]["id"]
            .as_str()
            .unwrap()
            .starts_with("call_"));
    }
}
