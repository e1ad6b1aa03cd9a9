//! Tools on `/v1/chat/completions`: OpenAI's messages as the chat template sees them
//! (`tool_calls` with their arguments as objects, `tool` messages with their call id), the
//! `tools` the template gets (as transformers' `apply_chat_template(tools=...)` passes
//! them), and the calls parsed from a reply (`chat::tools`) in OpenAI's shape.

use super::error::ApiError;
use super::openai::ChatMessage;
use crate::chat::tools::{ToolCall, ToolFormat};
use crate::chat::ChatTemplate;
use serde_json::{json, Map, Value};

/// The messages as JSON for the template: keys that are null are left out (as transformers
/// drops them), and a call's `arguments` string is parsed into the object templates expect.
pub fn messages(list: &[ChatMessage]) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::with_capacity(list.len());
    for m in list {
        let mut msg = Map::new();
        msg.insert("role".into(), json!(m.role));
        if let Some(c) = &m.content {
            msg.insert("content".into(), json!(c.text()?));
        }
        if let Some(calls) = &m.tool_calls {
            let calls: Vec<Value> = calls.iter().map(with_parsed_arguments).collect();
            msg.insert("tool_calls".into(), Value::Array(calls));
        }
        if let Some(id) = &m.tool_call_id {
            msg.insert("tool_call_id".into(), json!(id));
        }
        if let Some(name) = &m.name {
            msg.insert("name".into(), json!(name));
        }
        out.push(Value::Object(msg));
    }
    Ok(out)
}

fn with_parsed_arguments(call: &Value) -> Value {
    let mut call = call.clone();
    if let Some(args) = call.pointer_mut("/function/arguments") {
        if let Some(parsed) = args.as_str().and_then(|s| serde_json::from_str(s).ok()) {
            *args = parsed;
        }
    }
    call
}

/// The tools to render with, and how to parse the reply's calls: none without tools or
/// with `tool_choice: "none"`; a 400 for a template that does not read tools, or a
/// `tool_choice` that would force a call (not supported).
pub fn chosen(
    tools: Option<&Vec<Value>>,
    choice: Option<&Value>,
    template: &ChatTemplate,
) -> Result<Option<(Value, Option<ToolCalls>)>, ApiError> {
    match choice.and_then(Value::as_str) {
        None if choice.is_none() => {}
        Some("auto") => {}
        Some("none") => return Ok(None),
        _ => {
            let m = "tool_choice must be \"auto\" or \"none\": forcing a call is not supported";
            return Err(ApiError::bad_field("tool_choice", m));
        }
    }
    let Some(tools) = tools.filter(|t| !t.is_empty()) else {
        return Ok(None);
    };
    if tools.iter().any(|t| {
        t.pointer("/function/name")
            .and_then(Value::as_str)
            .is_none()
    }) {
        return Err(ApiError::bad_field(
            "tools",
            "each tool needs function.name",
        ));
    }
    if !template.reads_tools() {
        let m = "this model's chat template does not take tools: leave tools out";
        return Err(ApiError::bad_field("tools", m));
    }
    let calls = template.tool_format().map(|format| ToolCalls {
        format,
        names: tools
            .iter()
            .filter_map(|t| t.pointer("/function/name").and_then(Value::as_str))
            .map(str::to_string)
            .collect(),
    });
    Ok(Some((Value::Array(tools.clone()), calls)))
}

/// How to read a reply's tool calls: the template's format, and the functions that were
/// offered (a call to any other is not a call but text).
#[derive(Debug, Clone)]
pub struct ToolCalls {
    pub format: ToolFormat,
    pub names: Vec<String>,
}

impl ToolCalls {
    /// The reply's content and calls, as [`ToolFormat::parse`], with no calls when any
    /// names a function that was not offered.
    pub fn parse(&self, text: &str) -> (String, Vec<ToolCall>) {
        let (content, calls) = self.format.parse(text);
        match calls.iter().all(|c| self.names.contains(&c.name)) {
            true => (content, calls),
            false => (text.to_string(), Vec::new()),
        }
    }
}

/// Calls in OpenAI's shape: ids, `type`, arguments as a JSON string. With `index` for a
/// stream's delta.
pub fn openai_calls(calls: &[ToolCall], indexed: bool) -> Value {
    let calls: Vec<Value> = calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut v = json!({"id": format!("call_{:016x}", rand::random::<u64>()),
                               "type": "function",
                               "function": {"name": c.name, "arguments": c.arguments.to_string()}});
            if indexed {
                v["index"] = json!(i);
            }
            v
        })
        .collect();
    Value::Array(calls)
}
