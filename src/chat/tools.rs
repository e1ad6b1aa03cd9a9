//! Tool calls in a model's output, in the formats chat templates teach: Hermes'
//! `<tool_call>{"name", "arguments"}</tool_call>` (Qwen2.5, Qwen3, many fine-tunes), Llama
//! 3.x's bare `{"name", "parameters"}` JSON, and Mistral's `[TOOL_CALLS] [{"name",
//! "arguments"}, ..]`. The format is told by the template's own text, as llama-server and
//! vLLM's parsers are chosen for it; output that does not parse as calls stays content.

use serde_json::Value;

/// How a model's template asks it to write tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>\n{"name": .., "arguments": {..}}\n</tool_call>`, any number, after text.
    Hermes,
    /// The whole reply is `{"name": .., "parameters": {..}}` (after `<|python_tag|>`, a special
    /// token that decoding drops).
    Llama3Json,
    /// The reply is `[TOOL_CALLS] [{"name": .., "arguments": {..}}, ..]` (the marker is a
    /// special token in v3 tokenizers: it may be dropped, leaving the list).
    Mistral,
}

/// One call the model made.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// A JSON object.
    pub arguments: Value,
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const MISTRAL_MARK: &str = "[TOOL_CALLS]";

impl ToolFormat {
    /// The format a template teaches, if it renders `tools` at all.
    pub fn detect(template: &str) -> Option<Self> {
        if !template.contains("tools") {
            return None;
        }
        if template.contains(HERMES_OPEN) {
            Some(ToolFormat::Hermes)
        } else if template.contains(MISTRAL_MARK) {
            Some(ToolFormat::Mistral)
        } else if template.contains("\"parameters\"") || template.contains("<|python_tag|>") {
            Some(ToolFormat::Llama3Json)
        } else {
            None
        }
    }

    /// The content and the calls of a whole reply; no calls when none parse.
    pub fn parse(self, text: &str) -> (String, Vec<ToolCall>) {
        let calls = match self {
            ToolFormat::Hermes => return hermes(text),
            ToolFormat::Llama3Json => serde_json::from_str(text.trim()).ok().map(|v| vec![v]),
            ToolFormat::Mistral => {
                let t = text.trim_start();
                let list = t.strip_prefix(MISTRAL_MARK).unwrap_or(t).trim();
                serde_json::from_str::<Vec<Value>>(list).ok()
            }
        };
        match calls.map(|c| c.iter().map(call).collect::<Option<Vec<_>>>()) {
            Some(Some(calls)) if !calls.is_empty() => (String::new(), calls),
            _ => (text.to_string(), Vec::new()),
        }
    }

    /// How much of `text` (the reply so far) a stream may send as content: up to where a
    /// call begins or may begin. The rest waits for [`ToolFormat::parse`] at the end.
    pub fn content_len(self, text: &str) -> usize {
        match self {
            ToolFormat::Hermes => match text.find(HERMES_OPEN) {
                Some(at) => at,
                None => text.len() - partial_suffix(text, HERMES_OPEN),
            },
            // A call is the whole reply: hold while it may be one.
            ToolFormat::Llama3Json | ToolFormat::Mistral => {
                let t = text.trim_start();
                let may_be_call = t.is_empty()
                    || t.starts_with('{')
                    || t.starts_with('[')
                    || MISTRAL_MARK.starts_with(t)
                    || t.starts_with(MISTRAL_MARK);
                if may_be_call {
                    0
                } else {
                    text.len()
                }
            }
        }
    }
}

/// The calls between Hermes tags, and the text outside them.
fn hermes(text: &str) -> (String, Vec<ToolCall>) {
    let (mut content, mut calls, mut rest) = (String::new(), Vec::new(), text);
    while let Some(open) = rest.find(HERMES_OPEN) {
        let after = &rest[open + HERMES_OPEN.len()..];
        let (body, next) = match after.find(HERMES_CLOSE) {
            Some(close) => (&after[..close], &after[close + HERMES_CLOSE.len()..]),
            None => (after, ""), // cut by max_tokens or EOS: parse what is there
        };
        match serde_json::from_str(body.trim())
            .ok()
            .as_ref()
            .and_then(call)
        {
            Some(c) => calls.push(c),
            None => return (text.to_string(), Vec::new()),
        }
        content.push_str(&rest[..open]);
        rest = next;
    }
    content.push_str(rest);
    (content.trim().to_string(), calls)
}

/// `{"name": str, "arguments" or "parameters": object}` as a call.
fn call(v: &Value) -> Option<ToolCall> {
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = v.get("arguments").or_else(|| v.get("parameters"))?;
    // Some models write the arguments as a JSON string.
    let arguments = match arguments {
        Value::String(s) => serde_json::from_str(s).ok()?,
        other => other.clone(),
    };
    arguments
        .is_object()
        .then_some(ToolCall { name, arguments })
}

/// The length of the longest end of `text` that begins `marker` (held back in a stream).
fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn weather(city: &str) -> ToolCall {
        ToolCall {
            name: "get_weather".into(),
            arguments: json!({"city": city}),
        }
    }

    #[test]
    fn formats_are_told_by_the_template() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/chat_templates/");
        let read = |name: &str| std::fs::read_to_string(format!("{dir}{name}.jinja")).unwrap();
        assert_eq!(
            ToolFormat::detect(&read("qwen2.5")),
            Some(ToolFormat::Hermes)
        );
        assert_eq!(
            ToolFormat::detect(&read("llama3")),
            Some(ToolFormat::Llama3Json)
        );
        assert_eq!(ToolFormat::detect(&read("smollm2")), None);
        assert_eq!(ToolFormat::detect(&read("mistral")), None); // v0.1: no tools
        let v3 = "{%- if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}\
                  {{ '[TOOL_CALLS]' }}";
        assert_eq!(ToolFormat::detect(v3), Some(ToolFormat::Mistral));
    }

    #[test]
    fn hermes_calls_and_the_text_around_them() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \
                    {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \
                    \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>";
        let (content, calls) = ToolFormat::Hermes.parse(text);
        assert_eq!(content, "Let me check.");
        assert_eq!(calls, [weather("Paris"), weather("Rome")]);
        // Not JSON inside the tags: all of it stays content.
        let bad = "<tool_call>{name: x}</tool_call>";
        assert_eq!(ToolFormat::Hermes.parse(bad), (bad.to_string(), vec![]));
        assert_eq!(ToolFormat::Hermes.parse("plain"), ("plain".into(), vec![]));
    }

    #[test]
    fn llama3_and_mistral_calls() {
        let llama = " {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}";
        assert_eq!(ToolFormat::Llama3Json.parse(llama).1, [weather("Paris")]);
        let as_string =
            "{\"name\": \"get_weather\", \"parameters\": \"{\\\"city\\\": \\\"Paris\\\"}\"}";
        assert_eq!(
            ToolFormat::Llama3Json.parse(as_string).1,
            [weather("Paris")]
        );
        assert_eq!(ToolFormat::Llama3Json.parse("{\"a\": 1}").1, []);
        let mistral =
            "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}]";
        assert_eq!(ToolFormat::Mistral.parse(mistral).1, [weather("Rome")]);
        let dropped = &mistral["[TOOL_CALLS]".len()..];
        assert_eq!(ToolFormat::Mistral.parse(dropped).1, [weather("Rome")]);
    }

    #[test]
    fn streams_hold_back_what_may_be_a_call() {
        let h = ToolFormat::Hermes;
        assert_eq!(h.content_len("Sure"), 4);
        assert_eq!(h.content_len("Sure <tool"), 5);
        assert_eq!(h.content_len("Sure <tool_call>{\"na"), 5);
        assert_eq!(h.content_len("a < b"), 5);
        let l = ToolFormat::Llama3Json;
        assert_eq!(l.content_len("  "), 0);
        assert_eq!(l.content_len(" {\"name\""), 0);
        assert_eq!(l.content_len("Paris is"), 8);
        assert_eq!(ToolFormat::Mistral.content_len("[TOOL"), 0);
    }
}
