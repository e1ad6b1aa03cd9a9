//! `/v1/chat/completions` and llama-server's `/apply-template`: OpenAI's messages (with
//! `tools` and `chat_template_kwargs`) through the model's chat template, then the same
//! queue and replies as `/v1/completions` (`routes`).

use super::checks;
use super::error::ApiError;
use super::openai::ChatRequest;
use super::routes::{check_model, off_workers, parse, respond, Answer, Ask, Shared};
use super::tools::{self, ToolCalls};
use axum::body::Bytes;
use axum::extract::State;
use axum::response::IntoResponse;
use axum::Json;
use serde_json::json;

pub async fn completions(State(s): State<Shared>, body: Bytes) -> Answer {
    let req: ChatRequest = parse(&body)?;
    check_model(&s, &req.params)?;
    let logprobs = checks::chat_logprobs(req.logprobs, req.top_logprobs)?;
    let (text, format) = render_chat(&s, &req).await?;
    let prompt = off_workers(&s, move |s| {
        let bad = |e: crate::error::Error| ApiError::bad_field("messages", e.to_string());
        s.tokenizer.encode_plain(&text).map_err(bad)
    })
    .await?;
    let ask = Ask {
        chat: true,
        logprobs,
        tools: format,
    };
    respond(&s, prompt, &req.params, ask).await
}

/// llama-server's `POST /apply-template`: the prompt a chat request renders to, `{"prompt"}`.
pub async fn apply_template(State(s): State<Shared>, body: Bytes) -> Answer {
    let req: ChatRequest = parse(&body)?;
    let (prompt, _) = render_chat(&s, &req).await?;
    Ok(Json(json!({ "prompt": prompt })).into_response())
}

/// The chat request's messages (and tools, and `chat_template_kwargs`) through the model's
/// template, and the format of tool calls to parse from the reply.
async fn render_chat(
    s: &Shared,
    req: &ChatRequest,
) -> Result<(String, Option<ToolCalls>), ApiError> {
    let Some(template) = &s.template else {
        let m = format!(
            "{} has no chat template (chat_template.jinja or tokenizer_config.json): \
             send plain text to /v1/completions",
            s.model_id
        );
        return Err(ApiError::bad_request(m));
    };
    if req.messages.is_empty() {
        return Err(ApiError::bad_field(
            "messages",
            "messages must not be empty",
        ));
    }
    let tools = tools::chosen(req.tools.as_ref(), req.tool_choice.as_ref(), template)?;
    let messages = tools::messages(&req.messages)?;
    let mut extra = req.chat_template_kwargs.clone().unwrap_or_default();
    let format = tools.and_then(|(list, format)| {
        extra.insert("tools".into(), list);
        format
    });
    let text = off_workers(s, move |s| {
        let bad = |e: crate::error::Error| ApiError::bad_field("messages", e.to_string());
        let template = s.template.as_ref().expect("checked above");
        template.render_with(&messages, true, &extra).map_err(bad)
    })
    .await?;
    Ok((text, format))
}
