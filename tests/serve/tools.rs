//! `tools` on `/v1/chat/completions`: the template renders them as transformers does (the
//! prompt equals transformers' render in tests/data/chat_reference.json byte for byte, and
//! so does its token count, with OpenAI's string arguments parsed back into objects), `tool` messages are accepted, and
//! what cannot be honoured is a 400 naming the field.

use super::harness::Server;
use super::tiny_with_template;
use serde_json::{json, Value};
use std::path::PathBuf;

/// transformers' render of `conversation` by `template` (with tools), tokenized as the server
/// tokenizes a rendered chat: tiny-gqa's tokenizer, no special tokens added.
fn reference_tokens(template: &str, conversation: &str) -> (Value, usize) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("tests/data/chat_reference.json")).unwrap();
    let reference: Value = serde_json::from_str(&text).unwrap();
    let case = reference["renders"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["template"] == template && c["conversation"] == conversation)
        .unwrap_or_else(|| panic!("no {template}/{conversation} in chat_reference.json"))
        .clone();
    let tok =
        tokenizers::Tokenizer::from_file(root.join("models/tiny-gqa/tokenizer.json")).unwrap();
    let n = tok
        .encode(case["text"].as_str().unwrap(), false)
        .unwrap()
        .len();
    (case, n)
}

/// The reference's messages as an OpenAI client sends them: call arguments as JSON strings.
fn as_openai(messages: &Value) -> Value {
    let mut messages = messages.clone();
    for m in messages.as_array_mut().unwrap() {
        for call in m["tool_calls"].as_array_mut().into_iter().flatten() {
            let args = call["function"]["arguments"].to_string();
            call["function"]["arguments"] = json!(args);
        }
    }
    messages
}

#[test]
fn tools_reach_the_template_as_transformers_renders_them() {
    for template in ["qwen2.5", "llama3"] {
        let dir = tiny_with_template(template, &format!("tools-{template}"));
        // The tool prompts are longer than tiny-gqa's 256 positions: only their token counts
        // matter here, so the copy claims a longer context.
        let config = dir.join("config.json");
        let text = std::fs::read_to_string(&config).unwrap();
        let longer = text.replace(
            "\"max_position_embeddings\": 256",
            "\"max_position_embeddings\": 1024",
        );
        assert_ne!(text, longer);
        std::fs::write(&config, longer).unwrap();
        let server = Server::start(&["-m", dir.to_str().unwrap()]);
        for conversation in ["tools_ask", "tools_round_trip"] {
            let (case, tokens) = reference_tokens(template, conversation);
            let mut body = json!({"messages": as_openai(&case["messages"]),
                                  "tools": case["kwargs"]["tools"], "max_tokens": 1});
            // The rest of transformers' kwargs (the special tokens, Llama 3's date) as vLLM's
            // chat_template_kwargs: tiny-gqa has no tokenizer_config.json to name them.
            let mut kwargs = case["kwargs"].as_object().unwrap().clone();
            kwargs.remove("tools");
            body["chat_template_kwargs"] = Value::Object(kwargs);
            // llama-server's /apply-template: the rendered prompt, byte for byte.
            let (status, rendered) = server.post("/apply-template", &body);
            assert_eq!(status, 200, "{rendered}");
            assert_eq!(
                rendered["prompt"], case["text"],
                "{template}/{conversation}"
            );
            let (status, reply) = server.post("/v1/chat/completions", &body);
            assert_eq!(status, 200, "{template}/{conversation}: {reply}");
            assert_eq!(
                reply["usage"]["prompt_tokens"], tokens,
                "{template}/{conversation}"
            );
        }
        // tool_choice "none" leaves the tools out of the prompt.
        let (case, tokens) = reference_tokens(template, "tools_ask");
        let body = json!({"messages": case["messages"], "tools": case["kwargs"]["tools"],
                          "tool_choice": "none", "max_tokens": 1});
        let (status, reply) = server.post("/v1/chat/completions", &body);
        assert_eq!(status, 200, "{reply}");
        assert!(reply["usage"]["prompt_tokens"].as_u64().unwrap() < tokens as u64 - 50);
    }
}

#[test]
fn tools_that_cannot_be_honoured_answer_400() {
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
    let messages = json!([{"role": "user", "content": "hi"}]);
    let qwen = tiny_with_template("qwen2.5", "tools-400");
    let server = Server::start(&["-m", qwen.to_str().unwrap()]);
    let cases = [
        (
            json!({"tools": tools, "tool_choice": "required"}),
            "tool_choice",
        ),
        (
            json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}}),
            "tool_choice",
        ),
        (
            json!({"tools": [{"type": "function", "function": {}}]}),
            "tools",
        ),
        (json!({"tool_choice": "required"}), "tool_choice"),
    ];
    for (extra, field) in cases {
        let mut body = json!({"messages": messages, "max_tokens": 1});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (status, e) = server.post("/v1/chat/completions", &body);
        assert_eq!(
            (status, &e["error"]["param"]),
            (400, &json!(field)),
            "{body}: {e}"
        );
    }
    let (status, e) = server.post("/v1/completions", &json!({"prompt": "a", "tools": tools}));
    assert_eq!(
        (status, &e["error"]["param"]),
        (400, &json!("tools")),
        "{e}"
    );
    // SmolLM2's template does not read tools: they would be lost.
    let smol = tiny_with_template("smollm2", "tools-smol");
    let server = Server::start(&["-m", smol.to_str().unwrap()]);
    let body = json!({"messages": messages, "tools": tools, "max_tokens": 1});
    let (status, e) = server.post("/v1/chat/completions", &body);
    assert_eq!(
        (status, &e["error"]["param"]),
        (400, &json!("tools")),
        "{e}"
    );
}
