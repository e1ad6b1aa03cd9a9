//! Requests as a fuzzer would send them: every field of both endpoints set to other types and
//! to extremes. Each is answered (200, or a 4xx naming what is wrong), never a 500, and the
//! server keeps serving. PROPTEST_CASES raises the number of requests (`.ci/run`: 1,000).

use super::harness::Server;
use super::tiny_with_template;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::{json, Map, Value};

fn number() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!(0)),
        Just(json!(-1)),
        Just(json!(1)),
        Just(json!(2)),
        Just(json!(u64::MAX)),
        Just(json!(i64::MIN)),
        Just(json!(1e308)),
        Just(json!(-0.5)),
        Just(json!(0.5)),
        (0u32..100).prop_map(|n| json!(n)),
    ]
}

fn value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(json!({"type": "json_object"})),
        Just(json!({"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}})),
        Just(json!([{"type": "function", "function": {"name": "f"}}])),
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        number(),
        "[ -~]{0,12}".prop_map(Value::from),
        Just(json!("user")),
        Just(json!("")),
    ];
    leaf.prop_recursive(2, 8, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            prop::collection::vec(("[a-z_]{1,8}", inner), 0..3)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

const FIELDS: [&str; 27] = [
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repeat_penalty",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "model",
    "ignore_eos",
    "logprobs",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "chat_template_kwargs",
    "cache_prompt",
    "grammar",
    "frequency_penalty",
    "logit_bias",
    "echo",
];

/// A request that starts valid and has some fields replaced.
fn request() -> impl Strategy<Value = (bool, Value)> {
    let edits = prop::collection::vec((0..FIELDS.len(), value()), 0..5);
    (any::<bool>(), edits).prop_map(|(chat, edits)| {
        let mut body = Map::new();
        match chat {
            true => body.insert(
                "messages".into(),
                json!([{"role": "user", "content": "hi"}]),
            ),
            false => body.insert("prompt".into(), json!("ROMEO:")),
        };
        body.insert("max_tokens".into(), json!(4));
        for (field, v) in edits {
            body.insert(FIELDS[field].into(), v);
        }
        (chat, Value::Object(body))
    })
}

#[test]
fn every_request_is_answered_without_a_server_error() {
    // One server for every case (dropped, and so stopped, at the end): a small context, so
    // that no request generates for long.
    let dir = tiny_with_template("mistral", "fuzz");
    let s = Server::start(&[
        "-m",
        dir.to_str().unwrap(),
        "--context",
        "48",
        "--max-batch",
        "2",
    ]);
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(48);
    let mut runner = TestRunner::new(Config::with_cases(cases));
    let result = runner.run(&request(), |(chat, body)| {
        let path = if chat {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        };
        let (status, reply) = s.post_raw(path, &body.to_string(), None);
        prop_assert!(
            matches!(status, 200 | 400 | 404 | 408 | 413 | 429),
            "{body} -> {status} {reply}\n{}",
            s.log()
        );
        if status != 200 {
            prop_assert!(reply["error"]["message"].is_string(), "{body} -> {reply}");
        }
        prop_assert_eq!(s.get("/health").0, 200);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}
