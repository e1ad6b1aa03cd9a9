//! Bad requests answer OpenAI's error body with the right status, and never take the server
//! down; the API key; a clean exit on SIGTERM while a stream runs.

use super::harness::Server;
use super::{tiny_with_template, MODEL};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};

/// The status and error body of a POST, checked for OpenAI's shape.
fn error(server: &Server, path: &str, body: &str, key: Option<&str>) -> (u16, Value) {
    let (status, reply) = server.post_raw(path, body, key);
    let e = &reply["error"];
    assert!(e["message"].is_string() && e["type"].is_string(), "{reply}");
    assert!(e.get("code").is_some(), "{reply}");
    (status, e.clone())
}

#[test]
fn bad_requests_answer_400_404_and_the_server_keeps_serving() {
    let server = Server::start(&[]);
    let c = "/v1/completions";
    let cases = [
        ("{not json", 400, "invalid request body"),
        (r#"{"max_tokens": 5}"#, 400, "missing field `prompt`"),
        (r#"{"prompt": "a", "temperature": "hot"}"#, 400, "invalid"),
        (r#"{"prompt": "a", "max_tokens": -1}"#, 400, "invalid"),
        (r#"{"prompt": "a", "n": 2}"#, 400, "n must be 1"),
        (r#"{"prompt": "a", "max_tokens": 0}"#, 400, "at least 1"),
        (
            r#"{"prompt": "a", "max_tokens": 300}"#,
            400,
            "maximum context length is 256",
        ),
        (r#"{"prompt": "a", "top_p": 0}"#, 400, "top_p"),
        (r#"{"prompt": "a", "temperature": -1}"#, 400, "temperature"),
        (r#"{"prompt": "a", "stop": ""}"#, 400, "stop string"),
        (r#"{"prompt": [5, 99999]}"#, 400, "vocabulary size 1024"),
        (r#"{"prompt": []}"#, 400, "no tokens"),
        (r#"{"prompt": ["a", "b"]}"#, 400, "2 prompts"),
        (
            r#"{"prompt": "a", "model": "gpt-4o"}"#,
            404,
            "does not exist",
        ),
        // OpenAI's fields the server does not honour: a 400 naming them, not ignored.
        (
            r#"{"prompt": "a", "frequency_penalty": 0.5}"#,
            400,
            "frequency_penalty",
        ),
        (
            r#"{"prompt": "a", "presence_penalty": 1}"#,
            400,
            "presence_penalty",
        ),
        (
            r#"{"prompt": "a", "logit_bias": {"5": 10}}"#,
            400,
            "logit_bias",
        ),
        (r#"{"prompt": "a", "echo": true}"#, 400, "echo"),
        (r#"{"prompt": "a", "best_of": 3}"#, 400, "best_of"),
        (r#"{"prompt": "a", "suffix": "end"}"#, 400, "suffix"),
    ];
    for (body, want, says) in cases {
        let (status, e) = error(&server, c, body, None);
        assert_eq!(status, want, "{body}: {e}");
        if body.contains("_penalty\"") || body.contains("\"echo") || body.contains("best_of") {
            assert_eq!(e["param"].as_str(), Some(says), "{body}: {e}");
        }
        assert!(e["message"].as_str().unwrap().contains(says), "{body}: {e}");
    }
    // Stop strings are matched at every token on the scheduler thread: bounded.
    let many = vec!["a"; 250_000];
    for stop in [json!(many), json!(vec!["x"; 17]), json!(["y".repeat(257)])] {
        let body = json!({"prompt": "a", "stop": stop}).to_string();
        let (status, e) = error(&server, c, &body, None);
        assert_eq!(status, 400, "{e}");
        assert!(
            e["message"]
                .as_str()
                .unwrap()
                .contains("at most 16 stop strings"),
            "{e}"
        );
    }
    let long = "ROMEO ".repeat(300);
    let (status, e) = error(&server, c, &json!({"prompt": long}).to_string(), None);
    assert_eq!(
        (status, &e["code"]),
        (400, &json!("context_length_exceeded")),
        "{e}"
    );
    let (status, e) = error(&server, c, r#"{"prompt": "a", "model": "x"}"#, None);
    assert_eq!((status, &e["code"]), (404, &json!("model_not_found")));
    let (status, e) = error(&server, c, r#"{"prompt": "a", "n": 3}"#, None);
    assert_eq!((status, &e["param"]), (400, &json!("n")));
    let chat = "/v1/chat/completions";
    let body = r#"{"messages": [{"role": "user", "content": "hi"}]}"#;
    let (status, e) = error(&server, chat, body, None);
    assert!(
        status == 400 && e["message"].as_str().unwrap().contains("no chat template"),
        "{e}"
    );
    assert_eq!(server.get("/v2/nothing").0, 404);
    // Still up and serving.
    let (status, _) = server.post(c, &json!({"prompt": "ROMEO:", "max_tokens": 3}));
    assert_eq!(status, 200);
    assert!(!server.log().contains("internal error"), "{}", server.log());
}

#[test]
fn bad_chat_requests_answer_400() {
    let dir = tiny_with_template("mistral", "bad-chat");
    let server = Server::start(&["-m", dir.to_str().unwrap()]);
    let chat = "/v1/chat/completions";
    let cases = [
        (r#"{"messages": []}"#, "must not be empty"),
        (r#"{"messages": [{"content": "hi"}]}"#, "role"),
        // The template's own raise_exception, with its message.
        (
            r#"{"messages": [{"role": "assistant", "content": "hi"}]}"#,
            "must alternate",
        ),
        (
            r#"{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#,
            "image_url",
        ),
    ];
    for (body, says) in cases {
        let (status, e) = error(&server, chat, body, None);
        assert_eq!(status, 400, "{body}: {e}");
        assert!(e["message"].as_str().unwrap().contains(says), "{body}: {e}");
    }
    let ok = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3});
    assert_eq!(server.post(chat, &ok).0, 200);
}

#[test]
fn an_api_key_is_required_on_v1_from_the_flag_or_the_environment() {
    let flag = Server::start(&["--api-key", "sekrit"]);
    let env = Server::start_with_env(&[], &[("TINY_DECODER_API_KEY", "sekrit")]);
    let body = r#"{"prompt": "ROMEO:", "max_tokens": 3}"#;
    for server in [&flag, &env] {
        for key in [None, Some("wrong"), Some("sekri")] {
            let (status, e) = error(server, "/v1/completions", body, key);
            assert_eq!(
                (status, &e["code"]),
                (401, &json!("invalid_api_key")),
                "{key:?}"
            );
        }
        assert_eq!(server.get("/v1/models").0, 401);
        assert_eq!(server.get("/health").0, 200);
        let (status, reply) = server.post_raw("/v1/completions", body, Some("sekrit"));
        assert_eq!(status, 200, "{reply}");
    }
}

#[test]
fn sigterm_lets_a_running_stream_finish_and_exits_0() {
    let mut server = Server::start(&[]);
    let body = json!({"prompt": "ROMEO:", "max_tokens": 250, "stream": true, "model": MODEL});
    let mut events = BufReader::new(server.open_stream("/v1/completions", &body));
    let mut line = String::new();
    events.read_line(&mut line).unwrap();
    // SIGTERM once the stream has begun; it still ends with [DONE].
    let pid = server.pid();
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    let rest: Vec<String> = events.lines().map(|l| l.unwrap()).collect();
    let data: Vec<&str> = rest
        .iter()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"));
    // It finished, not cancelled: no error event, and the last chunk has its finish reason.
    assert!(!data.iter().any(|d| d.contains("\"error\"")), "{data:?}");
    let last: Value = serde_json::from_str(data[data.len() - 2]).unwrap();
    let reason = &last["choices"][0]["finish_reason"];
    assert!(reason == "length" || reason == "stop", "{last}");
    let status = server.terminate();
    assert!(status.success(), "{status:?}: {}", server.log());
    assert!(server.log().contains("shutting down"), "{}", server.log());
}

#[test]
fn bad_flags_and_a_taken_port_fail_in_one_line() {
    let fails = |args: &[&str], says: &str| {
        let out = std::process::Command::new(super::harness::BIN)
            .arg("serve")
            .args(args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    };
    fails(&["--context", "999"], "tiny-gqa's context length (256)");
    fails(&["--max-queue", "0"], "at least 1");
    fails(&["--api-key", ""], "must not be empty");
    // tiny-gqa's K/V: 2048 bytes a token, 524,288 for 256 positions.
    fails(
        &["--kv-memory", "500K"],
        "holds no sequence of --context 256 tokens",
    );
    fails(&["--kv-memory", "lots"], "--kv-memory");
    // A pool of whole blocks of 32 positions (65,536 bytes each): more than 2 sequences
    // of 256 positions, fewer than --max-batch's 8.
    let server = Server::start(&["--kv-memory", "1.1M", "--max-batch", "8"]);
    let blocks = 1_100_000 / 65536;
    let line = format!(
        "KV pool: {} bytes, {blocks} blocks of 32 positions",
        blocks * 65536
    );
    assert!(server.log().contains(&line), "{line}: {}", server.log());
    // 1e9 / 2048 bytes a token: 488,281 tokens, 119 sequences of 4096.
    let per_gb = "KV cache in f32, 2048 bytes a token: 1 GB holds 488281 tokens of context, or \
                  119 sequences of 4096";
    assert!(server.log().contains(per_gb), "{per_gb}: {}", server.log());
    let (_, health) = server.get("/health");
    assert_eq!(health["max_batch"], 8, "{health}");
    drop(server);
    let server = Server::start(&[]);
    let port = server.url.rsplit(':').next().unwrap().to_string();
    fails(&["--port", &port], "cannot listen on 127.0.0.1:");
}

#[test]
fn a_hostile_chat_template_answers_400_and_the_server_stays_up() {
    let templates = [
        ("{{ messages | tojson(indent=100000000000000) }}", "indent"),
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "steps",
        ),
    ];
    for (source, says) in templates {
        let dir = tiny_with_template("mistral", "hostile-template");
        std::fs::write(dir.join("chat_template.jinja"), source).unwrap();
        let server = Server::start(&["-m", dir.to_str().unwrap()]);
        let body = r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}"#;
        let (status, e) = error(&server, "/v1/chat/completions", body, None);
        assert_eq!(status, 400, "{source}: {e}");
        assert!(
            e["message"].as_str().unwrap().contains(says),
            "{source}: {e}"
        );
        assert_eq!(server.get("/health").0, 200);
        let plain = json!({"prompt": "ROMEO:", "max_tokens": 2});
        assert_eq!(server.post("/v1/completions", &plain).0, 200);
    }
}
