//! Hugging Face chat templates, rendered to the same text transformers renders.
//!
//! A chat template is a Jinja2 program shipped with the tokenizer. transformers runs it in
//! `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
//! extensions=[AssistantTracker, loopcontrols])` with its own `tojson`, `raise_exception`
//! and `strftime_now` (transformers/utils/chat_template_utils.py). We run it in minijinja,
//! a Rust Jinja2 by Jinja2's author with the same syntax and whitespace rules, set up the
//! same way; what minijinja does not do like jinja2 is bridged here:
//! - Python's str/dict/list methods (`.strip()`, `.items()`, ...): minijinja-contrib's
//!   `pycompat` callback.
//! - `tojson`: Python's `json.dumps(ensure_ascii=False)` text (`py::tojson`), not
//!   minijinja's filter, which HTML-escapes and spaces differently.
//! - `{% generation %}..{% endgeneration %}` (transformers' assistant-mask tag, which only
//!   passes its body through when rendering): rewritten to `{% with %}..{% endwith %}`, a
//!   body in its own scope like jinja2's call block, before compiling.
//! - `raise_exception(msg)` fails the render with the template's own message.
//! - jinja2 turns "\r\n" in the template into "\n"; `x is sequence` is true for str and dict.
//!
//! Still different (found by rendering probes through transformers' own environment; none
//! is used by the templates in tests/data/chat_templates): `strftime_now` formats the UTC
//! time (transformers: local time) and knows only the directives in `time::strftime`;
//! `tojson` takes keyword arguments only; Python's `'%s' % x`, a few rarer str methods and
//! filters (`center`, `rsplit`, `wordcount`) are missing; floats print without exponents
//! (`1e+16` as `10000000000000000.0`); what the sandbox refuses with a SecurityError
//! (`list.append`, `namespace(_x=..)`) is another error here, or allowed.

mod py;
mod time;

use super::tools::ToolFormat;
use crate::error::{Error, Result};
use crate::loader::TokenizerMeta;
use minijinja::value::{Serde, Value};
use minijinja::{Environment, ErrorKind};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// One turn of a conversation, as OpenAI-style message lists and chat templates spell it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// A compiled chat template and the special-token strings it sees.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token`/`eos_token` as transformers passes them (its `special_tokens_map`): a
    /// token the tokenizer does not have is left undefined, not set to "" or none.
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// Whether the template reads `tools`, and how it teaches the model to call them.
    reads_tools: bool,
    tool_format: Option<ToolFormat>,
}

/// Each render's budget: instructions, plus about one per 64 bytes of data the template
/// builds, so at most ~64 MB. SmolLM2's template renders 2,000 messages of 50 words within it.
const FUEL: u64 = 1_000_000;

/// The name the template is stored under; errors are reported by line instead.
const NAME: &str = "chat_template";

impl ChatTemplate {
    /// Compiles `source`; a syntax error names its line.
    pub fn new(source: &str, bos_token: Option<&str>, eos_token: Option<&str>) -> Result<Self> {
        let mut env = Environment::new();
        // trim_blocks/lstrip_blocks as transformers sets them; keep_trailing_newline stays
        // false, jinja2's default and minijinja's.
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(template_error)?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        // A template is a program from the checkpoint's author: bound each render's work and
        // the data it builds (minijinja charges about one fuel per 64 bytes).
        env.set_fuel(Some(FUEL));
        env.add_filter("tojson", py::tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", |format: &str| time::strftime_now(format));
        // jinja2's `sequence` test: anything with a length (str and dict included).
        env.add_test("sequence", |v: &Value| v.len().is_some());
        // jinja2 reads "\r\n" and "\r" in a template (text and string literals) as "\n".
        let source = source.replace("\r\n", "\n").replace('\r', "\n");
        env.add_template_owned(NAME, without_generation_tags(&source))
            .map_err(template_error)?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.map(str::to_string),
            eos_token: eos_token.map(str::to_string),
            reads_tools: source.contains("tools"),
            tool_format: ToolFormat::detect(&source),
        })
    }

    /// The checkpoint's chat template, with the bos/eos strings it is rendered with; `None`
    /// when it has none.
    pub fn from_meta(meta: &TokenizerMeta) -> Result<Option<Self>> {
        let Some(source) = &meta.chat_template else {
            return Ok(None);
        };
        Self::new(source, meta.bos_token.as_deref(), meta.eos_token.as_deref()).map(Some)
    }

    /// Whether the template reads the `tools` variable (else tools given to it would be lost).
    pub fn reads_tools(&self) -> bool {
        self.reads_tools
    }

    /// How the template teaches the model to write tool calls, when it is one we parse.
    pub fn tool_format(&self) -> Option<ToolFormat> {
        self.tool_format
    }

    /// Renders the conversation, ending with the assistant's header when
    /// `add_generation_prompt` is set (for templates that read it).
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, &serde_json::Map::new())
    }

    /// [`render`](Self::render) with further template variables (e.g. `date_string`, or
    /// `tools`), which override the special tokens, as transformers' keyword arguments do.
    /// `messages` may be any serializable shape: [`Message`]s, or OpenAI's JSON messages
    /// with `tool_calls` and `tool_call_id` (the server's).
    pub fn render_with<M: Serialize>(
        &self,
        messages: &[M],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        // The variables of transformers' render(): special tokens, tools and documents
        // (None), the caller's kwargs over those, then messages and add_generation_prompt.
        let mut ctx = BTreeMap::new();
        let tokens = [
            ("bos_token", &self.bos_token),
            ("eos_token", &self.eos_token),
        ];
        for (name, token) in tokens {
            if let Some(token) = token {
                ctx.insert(name.to_string(), Value::from(token.as_str()));
            }
        }
        ctx.insert("tools".into(), Value::from(()));
        ctx.insert("documents".into(), Value::from(()));
        for (name, value) in extra {
            if name == "messages" || name == "add_generation_prompt" {
                let msg = format!("{name} cannot be passed as an extra template variable");
                return Err(Error::Template { line: None, msg });
            }
            ctx.insert(name.clone(), Value::from(Serde(value)));
        }
        ctx.insert("messages".into(), Value::from(Serde(messages)));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        let template = self.env.get_template(NAME).map_err(template_error)?;
        template.render(Value::from(ctx)).map_err(template_error)
    }
}

/// The error `raise_exception` fails with, carried as the minijinja error's source so that
/// the template's message is reported as is.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    let err = minijinja::Error::new(ErrorKind::InvalidOperation, message.clone());
    Err(err.with_source(Raised(message)))
}

/// A minijinja error as one line with the template line it happened on: the template's own
/// message for `raise_exception`, minijinja's otherwise.
fn template_error(err: minijinja::Error) -> Error {
    let line = err.line().filter(|&l| l > 0);
    let mut source: Option<&dyn std::error::Error> = Some(&err);
    let mut raised = None;
    while let Some(e) = source {
        if let Some(r) = e.downcast_ref::<Raised>() {
            raised = Some(r.0.clone());
        }
        source = e.source();
    }
    let msg = raised.unwrap_or_else(|| match (err.kind(), err.detail()) {
        (ErrorKind::OutOfFuel, _) => format!(
            "rendering took more than {FUEL} steps or built too much text (a loop without \
             end, or a huge output): refused"
        ),
        (kind, Some(detail)) => format!("{kind}: {detail}"),
        (kind, None) => kind.to_string(),
    });
    let msg = msg.lines().collect::<Vec<_>>().join(" ");
    Error::Template { line, msg }
}

/// `source` with transformers' `{% generation %}`/`{% endgeneration %}` tags turned into
/// `{% with %}`/`{% endwith %}`; whitespace control marks and line numbers are kept.
fn without_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        rest = &rest[start..];
        // The closing mark after the opening one: in `{%}` the `%}` overlaps `{%`.
        let Some(end) = rest[2..].find("%}").map(|e| e + 2) else {
            break;
        };
        let tag = &rest[..end + 2];
        let inner = tag[2..end].trim_matches(['-', '+']).trim();
        match inner {
            "generation" => out.push_str(&tag.replacen("generation", "with", 1)),
            "endgeneration" => out.push_str(&tag.replacen("endgeneration", "endwith", 1)),
            _ => out.push_str(tag),
        }
        rest = &rest[end + 2..];
    }
    out.push_str(rest);
    out
}

/// Reads an OpenAI-style messages file: a JSON list of `{"role": str, "content": str}`.
pub fn read_messages(path: &Path) -> Result<Vec<Message>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::file(path, e))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| Error::file(path, format!("not JSON: {e}")))?;
    let list = json
        .as_array()
        .ok_or_else(|| Error::file(path, "expected a JSON list of messages"))?;
    let field = |i: usize, m: &serde_json::Value, name: &str| -> Result<String> {
        match m.get(name) {
            Some(serde_json::Value::String(s)) => Ok(s.clone()),
            Some(other) => Err(Error::file(
                path,
                format!("message {i}: \"{name}\" must be a string, not {other}"),
            )),
            None => Err(Error::file(
                path,
                format!("message {i}: missing \"{name}\""),
            )),
        }
    };
    let mut messages = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let Some(obj) = m.as_object() else {
            let msg = format!("message {i}: expected an object with \"role\" and \"content\"");
            return Err(Error::file(path, msg));
        };
        if let Some(key) = obj.keys().find(|k| *k != "role" && *k != "content") {
            return Err(Error::file(
                path,
                format!("message {i}: unknown field \"{key}\""),
            ));
        }
        messages.push(Message {
            role: field(i, m, "role")?,
            content: field(i, m, "content")?,
        });
    }
    Ok(messages)
}

#[cfg(test)]
mod tests;
