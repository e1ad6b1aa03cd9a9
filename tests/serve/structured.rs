//! `response_format` over HTTP: 20 sampled replies under a JSON schema each parse and satisfy
//! it, `json_object` gives an object, the log-probabilities are those of the masked
//! distribution, and a schema that cannot compile is a 400 naming `response_format`.

use super::harness::Server;
use super::tiny_with_template;
use serde_json::{json, Value};

fn schema() -> Value {
    json!({"type": "object",
           "properties": {"name": {"type": "string", "maxLength": 10},
                          "age": {"type": "integer", "minimum": 0, "maximum": 150},
                          "mood": {"enum": ["happy", "sad"]}},
           "required": ["name", "age", "mood"], "additionalProperties": false})
}

/// `v` satisfies [`schema`].
fn valid(v: &Value) -> bool {
    let Some(obj) = v.as_object() else {
        return false;
    };
    obj.len() == 3
        && obj["name"]
            .as_str()
            .is_some_and(|n| n.chars().count() <= 10)
        && obj["age"]
            .as_f64()
            .is_some_and(|a| a.fract() == 0.0 && (0.0..=150.0).contains(&a))
        && ["happy", "sad"].contains(&obj["mood"].as_str().unwrap_or(""))
}

#[test]
fn sampled_replies_under_a_json_schema_satisfy_it() {
    let server = Server::start(&[]);
    let format = json!({"type": "json_schema",
                        "json_schema": {"name": "person", "schema": schema(), "strict": true}});
    for seed in 0..20 {
        let body = json!({"prompt": "ROMEO:", "max_tokens": 100, "temperature": 1.0,
                          "seed": seed, "response_format": format});
        let (status, reply) = server.post("/v1/completions", &body);
        assert_eq!(status, 200, "{reply}");
        let choice = &reply["choices"][0];
        let text = choice["text"].as_str().unwrap();
        let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(valid(&v), "seed {seed}: {text}");
        assert_eq!(choice["finish_reason"], "stop", "{reply}");
    }
    // Greedy with log-probabilities: each is of the masked distribution, so the token the
    // schema forces (the opening brace and quote) has probability 1.
    let body = json!({"prompt": "ROMEO:", "max_tokens": 100, "temperature": 0, "logprobs": 1,
                      "response_format": format});
    let (status, reply) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{reply}");
    let first = reply["choices"][0]["logprobs"]["token_logprobs"][0]
        .as_f64()
        .unwrap();
    assert!(first.abs() < 1e-6, "{reply}");
    // Streamed, the same text.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = server.stream("/v1/completions", &streamed);
    assert_eq!(
        super::harness::streamed_text(&events),
        reply["choices"][0]["text"].as_str().unwrap()
    );
}

#[test]
fn json_object_and_bad_formats_on_chat() {
    let dir = tiny_with_template("smollm2", "structured-chat");
    let server = Server::start(&["-m", dir.to_str().unwrap()]);
    let messages = json!([{"role": "user", "content": "Describe yourself as JSON."}]);
    let body = json!({"messages": messages, "max_tokens": 150, "temperature": 0,
                      "response_format": {"type": "json_object"}});
    let (status, reply) = server.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{reply}");
    let text = reply["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(text.starts_with('{'), "{text}");
    if reply["choices"][0]["finish_reason"] == "stop" {
        assert!(
            serde_json::from_str::<Value>(text).unwrap().is_object(),
            "{text}"
        );
    }
    let bad = [
        json!({"type": "json_schema"}),
        json!({"type": "json_schema", "json_schema": {"schema": {"type": "object", "not": {}}}}),
        json!({"type": "xml"}),
    ];
    for format in bad {
        let body = json!({"messages": messages, "response_format": format});
        let (status, e) = server.post("/v1/chat/completions", &body);
        assert_eq!(
            (status, &e["error"]["param"]),
            (400, &json!("response_format")),
            "{e}"
        );
    }
    // A text format is no constraint; llama-server's GBNF `grammar` is refused by name.
    let body = json!({"messages": messages, "max_tokens": 2, "response_format": {"type": "text"}});
    assert_eq!(server.post("/v1/chat/completions", &body).0, 200);
    let body = json!({"messages": messages, "grammar": "root ::= \"a\""});
    let (status, e) = server.post("/v1/chat/completions", &body);
    assert_eq!(
        (status, &e["error"]["param"]),
        (400, &json!("grammar")),
        "{e}"
    );
}
