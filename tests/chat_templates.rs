//! Chat templates against transformers: the templates in tests/data/chat_templates rendered
//! by `tiny_decoder::chat` must equal transformers' renders in tests/data/chat_reference.json
//! byte for byte (scripts/chat_reference.py), fail where transformers fails with the
//! template's message, and, for SmolLM2, tokenize to the same ids.
//!
//! The token checks need the SmolLM2 checkpoint from scripts/build_smollm2.sh: where it has
//! not been built they say SKIPPED on stderr; TINY_DECODER_REQUIRE_SMOLLM2=1 makes that fail.

mod common;

use common::{ids, reference};
use serde_json::Value;
use std::path::PathBuf;
use tiny_decoder::chat::{ChatTemplate, Message};

fn data(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(path)
}

fn expected() -> Value {
    reference(&data("chat_reference.json"))
}

fn messages(v: &Value) -> Vec<Message> {
    serde_json::from_value(v.clone()).expect("reference messages")
}

/// The named template compiled with the special tokens of `kwargs` (absent or null: none).
fn template(name: &str, kwargs: &Value) -> ChatTemplate {
    let path = data(&format!("chat_templates/{name}.jinja"));
    let source = std::fs::read_to_string(&path).expect("template file");
    let token = |key: &str| kwargs.get(key).and_then(Value::as_str);
    ChatTemplate::new(&source, token("bos_token"), token("eos_token")).expect("template compiles")
}

/// Renders one reference case as transformers did: its kwargs as extra variables.
fn render(case: &Value) -> tiny_decoder::Result<String> {
    let name = case["template"].as_str().expect("template name");
    let kwargs = &case["kwargs"];
    let extra = kwargs.as_object().cloned().unwrap_or_default();
    let add = case["add_generation_prompt"]
        .as_bool()
        .expect("add_generation_prompt");
    // As JSON, not `Message`s: the tool cases carry `tool_calls` and `tool_call_id`.
    let messages = case["messages"].as_array().expect("reference messages");
    template(name, kwargs).render_with(messages, add, &extra)
}

fn label(case: &Value) -> String {
    format!(
        "{} / {} / add_generation_prompt={}",
        case["template"], case["conversation"], case["add_generation_prompt"]
    )
}

#[test]
fn every_template_renders_what_transformers_renders() {
    let r = expected();
    let cases = r["renders"].as_array().expect("renders");
    let mut seen = std::collections::BTreeSet::new();
    for case in cases.iter().filter(|c| c["error"] == false) {
        let want = case["text"].as_str().expect("text");
        let got = render(case).unwrap_or_else(|e| panic!("{}: {e}", label(case)));
        assert_eq!(got, want, "{}", label(case));
        seen.insert(case["template"].as_str().unwrap_or_default().to_string());
    }
    // Not vacuous: every template has rendered cases.
    assert_eq!(seen.len(), 5, "templates checked: {seen:?}");
}

#[test]
fn raise_exception_fails_with_the_template_message() {
    let r = expected();
    let cases = r["renders"].as_array().expect("renders");
    let errors: Vec<&Value> = cases.iter().filter(|c| c["error"] == true).collect();
    assert!(!errors.is_empty(), "no error cases in the reference");
    for case in errors {
        let want = case["error_message"].as_str().expect("error_message");
        let err = render(case).expect_err(&label(case)).to_string();
        assert!(
            err.starts_with("chat template, line 1: "),
            "{}: {err}",
            label(case)
        );
        assert!(
            err.contains(want) && !err.contains('\n'),
            "{}: {err}",
            label(case)
        );
    }
}

/// SmolLM2's tokenizer, or None (SKIPPED) where the checkpoint is not built; as
/// tests/smollm2.rs finds it: `target/models`, or `$TINY_DECODER_SMOLLM2`.
fn smollm2_tokenizer() -> Option<tokenizers::Tokenizer> {
    let dir = common::checkpoint("smollm2-135m-instruct")?;
    Some(tiny_decoder::loader::load_tokenizer(&dir.join("tokenizer.json")).unwrap())
}

#[test]
fn smollm2_renders_tokenize_to_transformers_ids() {
    let Some(tok) = smollm2_tokenizer() else {
        return;
    };
    let encode = |text: &str| tok.encode(text, false).unwrap().get_ids().to_vec();
    let r = expected();
    let mut checked = 0;
    for case in r["renders"].as_array().expect("renders") {
        if case["template"] == "smollm2" {
            // apply_chat_template(tokenize=True) encodes without adding special tokens.
            assert_eq!(
                encode(&render(case).unwrap()),
                ids(&case["token_ids"]),
                "{}",
                label(case)
            );
            checked += 1;
        }
    }
    // The prompts of the greedy chats the CLI is checked against.
    let smollm2 = template("smollm2", &r["template_kwargs"]["smollm2"]);
    let mut prompts: Vec<&Value> = r["chat_greedy"]["turns"]
        .as_array()
        .expect("turns")
        .iter()
        .collect();
    prompts.push(&r["capital"]);
    for p in prompts {
        let text = smollm2.render(&messages(&p["messages"]), true).unwrap();
        assert_eq!(encode(&text), ids(&p["prompt_ids"]), "{}", p["messages"]);
        checked += 1;
    }
    assert!(checked >= 10, "only {checked} token checks");
}
