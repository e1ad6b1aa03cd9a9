//! What a request's fields must satisfy before it is queued, each failure a 400 naming the
//! field: one choice, bounded stop strings, a prompt that fits the context with its
//! completion, and sampling values in range.

use super::error::ApiError;
use super::openai::{Params, Unhonoured};
use crate::config::GenerationConfig;
use crate::grammar::Spec;
use crate::sampling::{Requested, Sampler};
use serde_json::Value;

/// Most stop strings a request may send (OpenAI allows 4), and their longest.
const MAX_STOPS: usize = 16;
const MAX_STOP_BYTES: usize = 256;
/// Most alternatives a request may ask for with each token (OpenAI's `top_logprobs` bound).
const MAX_TOP_LOGPROBS: usize = 20;

/// Chat's `logprobs` and `top_logprobs` as the number of alternatives to report with each
/// token (`None`: no log-probabilities).
pub fn chat_logprobs(
    logprobs: Option<bool>,
    top: Option<usize>,
) -> Result<Option<usize>, ApiError> {
    match (logprobs.unwrap_or(false), top) {
        (_, Some(n)) if n > MAX_TOP_LOGPROBS => Err(top_bound("top_logprobs", n)),
        (false, Some(_)) => Err(ApiError::bad_field(
            "top_logprobs",
            "top_logprobs requires logprobs to be true",
        )),
        (false, None) => Ok(None),
        (true, top) => Ok(Some(top.unwrap_or(0))),
    }
}

/// `/v1/completions`' `logprobs`: the number of alternatives to report with each token.
pub fn completion_logprobs(logprobs: Option<usize>) -> Result<Option<usize>, ApiError> {
    match logprobs {
        Some(n) if n > MAX_TOP_LOGPROBS => Err(top_bound("logprobs", n)),
        n => Ok(n),
    }
}

fn top_bound(field: &'static str, n: usize) -> ApiError {
    ApiError::bad_field(
        field,
        format!("{field} must be between 0 and {MAX_TOP_LOGPROBS}, got {n}"),
    )
}

/// The checks a request's fields pass before it is queued (each failure a 400 naming the
/// field).
impl Params {
    /// `n`, the stop strings, the token budget and the sampling fields; returns `max_tokens`
    /// (absent: the rest of the context) and the sampler.
    pub fn check(
        &self,
        prompt: &[u32],
        context: usize,
        generation: &GenerationConfig,
    ) -> Result<(usize, Sampler), ApiError> {
        let p = self;
        p.unhonoured.check()?;
        if p.n.is_some_and(|n| n != 1) {
            return Err(ApiError::bad_field(
                "n",
                "n must be 1: one choice per request",
            ));
        }
        let stops = p.stops();
        if stops.iter().any(String::is_empty) {
            return Err(ApiError::bad_field(
                "stop",
                "a stop string must not be empty",
            ));
        }
        // Each stop string is matched on the scheduler thread at every token: bounded.
        if stops.len() > MAX_STOPS || stops.iter().any(|s| s.len() > MAX_STOP_BYTES) {
            let m =
                format!("at most {MAX_STOPS} stop strings of at most {MAX_STOP_BYTES} bytes each");
            return Err(ApiError::bad_field("stop", m));
        }
        if prompt.is_empty() {
            return Err(ApiError::bad_field(
                "prompt",
                "the prompt encodes to no tokens",
            ));
        }
        let max_tokens = match p.max_tokens() {
            Some(0) => {
                return Err(ApiError::bad_field(
                    "max_tokens",
                    "max_tokens must be at least 1",
                ))
            }
            Some(m) => m,
            None => context.saturating_sub(prompt.len()).max(1),
        };
        let total = prompt.len().saturating_add(max_tokens);
        if total > context {
            let m = format!(
                "this model's maximum context length is {} tokens per request (--context), but {total} \
                 were requested ({} in the prompt, {max_tokens} for the completion): shorten the \
                 prompt or lower max_tokens",
                context,
                prompt.len()
            );
            return Err(ApiError::bad_request(m).with_code("context_length_exceeded"));
        }
        Ok((max_tokens, p.sampler(generation)?))
    }

    /// The sampler for the request's fields; one left out takes generation_config.json's value,
    /// else llama.cpp's, as in `generate`. The seed is random unless given.
    fn sampler(&self, generation: &GenerationConfig) -> Result<Sampler, ApiError> {
        let p = self;
        let bad = |field: &'static str, rule: &str, v: f32| {
            Err(ApiError::bad_field(
                field,
                format!("{field} must be {rule}, got {v}"),
            ))
        };
        match (p.temperature, p.top_p, p.min_p, p.repeat_penalty) {
            (Some(t), ..) if t < 0.0 => return bad("temperature", ">= 0", t),
            (_, Some(v), ..) if !(v > 0.0 && v <= 1.0) => return bad("top_p", "in (0, 1]", v),
            (_, _, Some(v), _) if !(0.0..=1.0).contains(&v) => return bad("min_p", "in [0, 1]", v),
            (.., Some(v)) if v <= 0.0 => return bad("repeat_penalty", "> 0", v),
            _ => {}
        }
        let requested = Requested {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            min_p: p.min_p,
            repeat_penalty: p.repeat_penalty,
            seed: p.seed.map(|s| s as u64),
        };
        Sampler::new(&requested.resolve(generation))
            .map_err(|e| ApiError::bad_request(e.to_string()))
    }
}

impl Unhonoured {
    /// Each field at its neutral value (or absent) passes; anything else is a 400 naming it.
    fn check(&self) -> Result<(), ApiError> {
        let u = self;
        let tool_choice = |v: &serde_json::Value| v == "none" || v == "auto";
        let refused = [
            (
                "frequency_penalty",
                u.frequency_penalty.is_some_and(|v| v != 0.0),
            ),
            (
                "presence_penalty",
                u.presence_penalty.is_some_and(|v| v != 0.0),
            ),
            (
                "logit_bias",
                u.logit_bias.as_ref().is_some_and(|m| !m.is_empty()),
            ),
            ("grammar", u.grammar.as_ref().is_some_and(|v| !v.is_null())),
            ("tools", u.tools.as_ref().is_some_and(|t| !t.is_empty())),
            (
                "tool_choice",
                u.tool_choice.as_ref().is_some_and(|v| !tool_choice(v)),
            ),
            ("echo", u.echo == Some(true)),
            ("best_of", u.best_of.is_some_and(|n| n != 1)),
            ("suffix", u.suffix.as_ref().is_some_and(|s| !s.is_empty())),
        ];
        match refused.into_iter().find(|(_, refused)| *refused) {
            Some((field, _)) => Err(ApiError::bad_field(
                field,
                format!("{field} is not supported by this server: leave it out"),
            )),
            None => Ok(()),
        }
    }
}

/// `response_format` as the grammar the reply must match: `None` for text.
pub fn response_format(v: Option<&Value>) -> Result<Option<Spec>, ApiError> {
    let field = "response_format";
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    match v["type"].as_str() {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Spec::JsonObject)),
        Some("json_schema") => match v.pointer("/json_schema/schema") {
            Some(schema) if schema.is_object() || schema.is_boolean() => {
                Ok(Some(Spec::JsonSchema(schema.clone())))
            }
            _ => Err(ApiError::bad_field(
                field,
                "json_schema needs json_schema.schema, a JSON schema object",
            )),
        },
        _ => Err(ApiError::bad_field(
            field,
            "response_format.type must be \"text\", \"json_object\" or \"json_schema\"",
        )),
    }
}
