//! The OpenAI HTTP API's shapes: requests as its clients send them (fields we do not know
//! are ignored, as OpenAI ignores them), replies and stream chunks as its clients parse them,
//! and (in `error`) its error body; `checks` holds what a request's fields must satisfy.

use super::error::ApiError;
use super::logprobs::{self, Logprobs};
use super::request::Finish;
use super::tools;
use super::tools::ToolCalls;
use crate::chat::tools::ToolCall;
use crate::generate::StopReason;
use serde::Deserialize;
use serde_json::{json, Value};

/// The fields `/v1/completions` and `/v1/chat/completions` share.
#[derive(Debug, Default, Deserialize)]
pub struct Params {
    /// Absent is accepted (llama-server does the same); present, it must be the served id.
    pub model: Option<String>,
    pub max_tokens: Option<usize>,
    /// Chat's newer name for `max_tokens`; it wins when both are given.
    pub max_completion_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// Not OpenAI's but llama-server's and vLLM's, and the `generate` flags' namesakes.
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub repeat_penalty: Option<f32>,
    /// vLLM's and llama-server's: keep generating past EOS ids (for benchmarks).
    pub ignore_eos: Option<bool>,
    /// llama-server's: `false` prefills the whole prompt even when a free cache holds its
    /// beginning (for comparisons); default true.
    pub cache_prompt: Option<bool>,
    pub stop: Option<Stop>,
    /// OpenAI's seed is any integer; a negative one is used as its two's complement.
    pub seed: Option<i64>,
    pub n: Option<usize>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// `{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ..}}`.
    pub response_format: Option<Value>,
    /// Fields OpenAI defines that this server does not honour: accepted at their neutral
    /// values, a 400 naming them otherwise (`checks`), never silently ignored.
    #[serde(flatten)]
    pub unhonoured: Unhonoured,
}

/// OpenAI's fields this server cannot honour (yet), as sent.
#[derive(Debug, Default, Deserialize)]
pub struct Unhonoured {
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    /// llama-server's GBNF grammar: llguidance reads Lark, not GBNF.
    pub grammar: Option<Value>,
    /// Chat takes these (`ChatRequest`); `/v1/completions` does not.
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub echo: Option<bool>,
    pub best_of: Option<usize>,
    pub suffix: Option<String>,
}

impl Params {
    pub fn stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    /// Whether a stream ends with a chunk that carries `usage`.
    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false)
    }

    pub fn max_tokens(&self) -> Option<usize> {
        self.max_completion_tokens.or(self.max_tokens)
    }

    pub fn stops(&self) -> Vec<String> {
        match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        }
    }
}

/// `stop`: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    /// Report this many most likely tokens (0-20) with each token's log-probability.
    pub logprobs: Option<usize>,
    #[serde(flatten)]
    pub params: Params,
}

/// `prompt`: text, token ids, or a list of texts (of which we serve one: `n` is 1).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    /// Report each token's log-probability, with `top_logprobs` (0-20) alternatives.
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<usize>,
    /// Functions the model may call, passed to the chat template as transformers does.
    pub tools: Option<Vec<Value>>,
    /// `"auto"` (the default with tools) or `"none"` (the tools are not shown to the model).
    pub tool_choice: Option<Value>,
    /// vLLM's: further variables for the chat template (e.g. `enable_thinking`,
    /// `date_string`), as transformers' `apply_chat_template(**kwargs)`.
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    #[serde(flatten)]
    pub params: Params,
}

#[derive(Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    /// `null` for an assistant turn that only called tools.
    pub content: Option<Content>,
    /// An assistant turn's calls, as OpenAI returned them (arguments as a JSON string).
    pub tool_calls: Option<Vec<Value>>,
    /// A `tool` message: the call it answers, and the function's name.
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

/// A message's content: a string, or a list of parts of which we read the text ones.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

impl Content {
    /// The text of the message; a part other than text is an error.
    pub fn text(&self) -> Result<String, ApiError> {
        match self {
            Content::Text(t) => Ok(t.clone()),
            Content::Parts(parts) => parts
                .iter()
                .map(|p| match (p.kind.as_str(), &p.text) {
                    ("text", Some(t)) => Ok(t.as_str()),
                    (kind, _) => Err(ApiError::bad_request(format!(
                        "content part of type {kind:?} is not supported: only text parts are"
                    ))),
                })
                .collect(),
        }
    }
}

/// `finish_reason`: `stop` for an EOS token or a stop string, `length` for `max_tokens` or
/// the end of the context.
pub fn finish_reason(r: StopReason) -> &'static str {
    match r {
        StopReason::Eos | StopReason::Stop | StopReason::Interrupted => "stop",
        StopReason::Length | StopReason::Context => "length",
    }
}

/// What every reply and chunk of one request repeats.
#[derive(Debug, Clone)]
pub struct Reply {
    pub id: String,
    pub created: u64,
    pub model: String,
    /// `/v1/chat/completions` (messages and deltas) rather than `/v1/completions` (text).
    pub chat: bool,
    /// Tools were given: calls to them become `tool_calls`.
    pub tools: Option<ToolCalls>,
}

impl Reply {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.chat, chunk) {
            (true, false) => "chat.completion",
            (true, true) => "chat.completion.chunk",
            (false, _) => "text_completion",
        }
    }

    /// The whole reply of a request without `stream`.
    pub fn whole(&self, f: &Finish) -> Value {
        let mut reason = finish_reason(f.reason);
        let lp = self.logprobs(f.logprobs.as_deref(), 0);
        let mut message = json!({"role": "assistant", "content": f.text});
        if let Some(tools) = &self.tools {
            let (content, calls) = tools.parse(&f.text);
            if !calls.is_empty() {
                let content = (!content.is_empty()).then_some(content);
                message = json!({"role": "assistant", "content": content,
                                 "tool_calls": tools::openai_calls(&calls, false)});
                reason = "tool_calls";
            }
        }
        let choice = match self.chat {
            true => json!({"index": 0, "message": message, "logprobs": lp,
                           "finish_reason": reason}),
            false => json!({"index": 0, "text": f.text, "logprobs": lp, "finish_reason": reason}),
        };
        json!({"id": self.id, "object": self.object(false), "created": self.created,
               "model": self.model, "choices": [choice], "usage": usage(f)})
    }

    /// `logprobs` in this endpoint's shape, `null` when not asked for; `offset`: the
    /// completion's characters before these tokens.
    fn logprobs(&self, tokens: Option<&[Logprobs]>, offset: usize) -> Value {
        match (tokens, self.chat) {
            (None, _) => Value::Null,
            (Some(t), true) => logprobs::chat(t),
            (Some(t), false) => logprobs::completion(t, offset),
        }
    }

    /// One chunk of a stream: `text` so far unsent with its tokens' log-probabilities (for
    /// chat, `None` with no reason is the opening chunk that names the role), and the finish
    /// reason in the last one. `offset`: the completion's characters sent before.
    pub fn chunk(
        &self,
        text: Option<(&str, Option<&[Logprobs]>)>,
        offset: usize,
        reason: Option<&str>,
        with_usage: bool,
    ) -> Value {
        let lp = self.logprobs(text.and_then(|t| t.1), offset);
        let choice = match self.chat {
            true => {
                let delta = match (text, reason) {
                    (Some((t, _)), _) => json!({"content": t}),
                    (None, None) => json!({"role": "assistant", "content": ""}),
                    (None, Some(_)) => json!({}),
                };
                json!({"index": 0, "delta": delta, "logprobs": lp, "finish_reason": reason})
            }
            false => json!({"index": 0, "text": text.map_or("", |t| t.0), "logprobs": lp,
                            "finish_reason": reason}),
        };
        let mut chunk = json!({"id": self.id, "object": self.object(true),
                               "created": self.created, "model": self.model,
                               "choices": [choice]});
        if with_usage {
            // OpenAI's chunks carry `usage: null` until the last, extra one.
            chunk["usage"] = Value::Null;
        }
        chunk
    }

    /// A stream's chunk with the reply's tool calls (sent once, at the end).
    pub fn tool_calls_chunk(&self, calls: &[ToolCall]) -> Value {
        let delta = json!({"tool_calls": tools::openai_calls(calls, true)});
        json!({"id": self.id, "object": self.object(true), "created": self.created,
               "model": self.model,
               "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": null}]})
    }

    /// The extra last chunk of `stream_options.include_usage`: no choices, the counts.
    pub fn usage_chunk(&self, f: &Finish) -> Value {
        json!({"id": self.id, "object": self.object(true), "created": self.created,
               "model": self.model, "choices": [], "usage": usage(f)})
    }
}

fn usage(f: &Finish) -> Value {
    json!({"prompt_tokens": f.prompt_tokens, "completion_tokens": f.completion_tokens,
           "total_tokens": f.prompt_tokens + f.completion_tokens,
           "prompt_tokens_details": {"cached_tokens": f.cached_tokens}})
}
