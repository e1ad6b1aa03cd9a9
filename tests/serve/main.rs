//! `tiny-decoder serve` over HTTP, as a client sees it: both endpoints whole and streamed,
//! greedy replies equal to `generate`'s (16 at once through the batching scheduler), a
//! client that leaves mid-stream, a full queue, every bad request, a clean shutdown, the
//! faults and stalled clients it survives, and fuzzed requests.
//! The bundled tiny-gqa runs everywhere; chat uses a copy of it with a chat template.

mod fuzz;
mod harness;
mod logprobs;
mod metrics;
mod pool;
mod prefix;
mod structured;
mod tools;

use harness::{finish_reason, generate, streamed_text, Server, SLOW};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;

const MODEL: &str = "tiny-gqa";

/// models/tiny-gqa copied to a scratch directory of its own (`case`: tests run at once) with
/// a chat template (`template`, from tests/data/chat_templates).
fn tiny_with_template(template: &str, case: &str) -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("serve-{case}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(root.join("models/tiny-gqa")).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    let src = root.join(format!("tests/data/chat_templates/{template}.jinja"));
    std::fs::copy(src, dir.join("chat_template.jinja")).unwrap();
    dir
}

/// The reply's one choice agrees with `generate --json`'s output `g`.
fn assert_matches(reply: &Value, g: &Value, text: &str) {
    let choice = &reply["choices"][0];
    assert_eq!(text, g["text"].as_str().unwrap(), "{reply}");
    assert_eq!(
        choice["finish_reason"],
        finish_reason(&g["stop_reason"]),
        "{reply}"
    );
    let usage = &reply["usage"];
    let (prompt, completion) = (g["prompt_token_ids"].as_array(), g["token_ids"].as_array());
    assert_eq!(usage["prompt_tokens"], prompt.unwrap().len(), "{reply}");
    assert_eq!(
        usage["completion_tokens"],
        completion.unwrap().len(),
        "{reply}"
    );
    let total =
        usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap();
    assert_eq!(usage["total_tokens"], total);
}

/// A stream's shape: chunks of one id, the finish reason in the last choice, then the usage
/// chunk (when asked) and `[DONE]`; returns the usage chunk's counts as a whole reply would.
fn check_stream(events: &[Value], object: &str) -> Value {
    assert_eq!(events.last(), Some(&json!("[DONE]")), "{events:?}");
    let chunks = &events[..events.len() - 1];
    let id = &chunks[0]["id"];
    assert!(
        chunks
            .iter()
            .all(|c| c["id"] == *id && c["object"] == object),
        "{chunks:?}"
    );
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]), "{usage}");
    let last = &chunks[chunks.len() - 2]["choices"][0];
    let reasons = chunks
        .iter()
        .filter(|c| !c["choices"][0]["finish_reason"].is_null());
    assert_eq!(
        reasons.count(),
        1,
        "one finish_reason, in the last choice: {chunks:?}"
    );
    json!({"choices": [last], "usage": usage["usage"]})
}

#[test]
fn completions_whole_and_streamed_equal_generate() {
    let server = Server::start(&[]);
    let (status, health) = server.get("/health");
    assert_eq!((status, &health["status"]), (200, &json!("ok")), "{health}");
    let (status, models) = server.get("/v1/models");
    assert_eq!((status, &models["data"][0]["id"]), (200, &json!(MODEL)));
    assert_eq!(
        server.get("/v1/models/tiny-gqa"),
        (200, models["data"][0].clone())
    );
    assert_eq!(server.get("/v1/models/tiny-mla").0, 404);

    let prompt = "ROMEO:\nBut soft, what light";
    let g = generate(MODEL, prompt, 40, &["--raw"]);
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0});
    let (status, reply) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["object"], "text_completion");
    assert_matches(&reply, &g, reply["choices"][0]["text"].as_str().unwrap());

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let events = server.stream("/v1/completions", &streamed);
    let end = check_stream(&events, "text_completion");
    assert_matches(&end, &g, &streamed_text(&events));

    // A stop string ends the text before it, as `generate --stop` does; so do token ids.
    let stop = g["text"]
        .as_str()
        .unwrap()
        .split_whitespace()
        .nth(3)
        .unwrap()
        .to_string();
    let gs = generate(MODEL, prompt, 40, &["--raw", "--stop", &stop]);
    let ids = g["prompt_token_ids"].clone();
    let body = json!({"prompt": ids, "max_tokens": 40, "temperature": 0, "stop": [stop]});
    let (status, reply) = server.post("/v1/completions", &body);
    assert_eq!(
        (status, &reply["choices"][0]["finish_reason"]),
        (200, &json!("stop"))
    );
    assert_eq!(reply["choices"][0]["text"], gs["text"], "{reply}");
    // Unknown fields are ignored, as OpenAI ignores them; its own at their neutral values.
    let body = json!({"prompt": prompt, "max_tokens": 3, "user": "me", "frequency_penalty": 0});
    assert_eq!(server.post("/v1/completions", &body).0, 200);
}

#[test]
fn chat_completions_use_the_template_whole_and_streamed() {
    let dir = tiny_with_template("smollm2", "chat");
    let m = dir.to_str().unwrap();
    let server = Server::start(&["-m", m]);
    let id = dir.file_name().unwrap().to_str().unwrap();
    assert_eq!(server.get("/v1/models").1["data"][0]["id"], id);

    let question = "What light through yonder window breaks?";
    let g = generate(m, question, 30, &[]);
    assert_eq!(g["chat_template_applied"], true);
    let messages = json!([{"role": "user", "content": question}]);
    let body = json!({"model": id, "messages": messages, "max_tokens": 30, "temperature": 0});
    let (status, reply) = server.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["object"], "chat.completion");
    let message = &reply["choices"][0]["message"];
    assert_eq!(message["role"], "assistant");
    assert_matches(&reply, &g, message["content"].as_str().unwrap());

    // Content as a list of text parts is the same message.
    let mut streamed = body.clone();
    streamed["messages"] =
        json!([{"role": "user", "content": [{"type": "text", "text": question}]}]);
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let events = server.stream("/v1/chat/completions", &streamed);
    assert_eq!(
        events[0]["choices"][0]["delta"]["role"], "assistant",
        "{events:?}"
    );
    let end = check_stream(&events, "chat.completion.chunk");
    assert_matches(&end, &g, &streamed_text(&events));
}

#[test]
fn sixteen_concurrent_greedy_requests_each_equal_generate() {
    // Prompts of many lengths, one longer than a prefill step (128 tokens) so that it goes
    // in over two steps beside running sequences; half streamed, half whole.
    let lines = [
        "ROMEO:",
        "JULIET:\nO Romeo, Romeo",
        "First Citizen:\nBefore we proceed any further",
        "KING RICHARD II:",
        "To be, or not",
        "MENENIUS:\nWhat work's, my countrymen",
        "HAMLET:\nThe rest",
        "GLOUCESTER:\nNow is the winter of our discontent",
        "A",
        "LADY CAPULET:\nWhat, ho",
        "Second Servingman:",
        "O, she doth teach the torches",
        "BRUTUS:\nRomans, countrymen, and lovers!",
        "CORIOLANUS:",
        "Thou art",
        "Nurse:",
    ];
    let long = "The quality of mercy is not strain'd; it droppeth as the gentle rain. ".repeat(5);
    let mut prompts: Vec<String> = lines.iter().map(|s| s.to_string()).collect();
    prompts[15] = long;
    let expected: Vec<(String, usize, Value)> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            // Prompt and completion within the context of 256 tokens.
            let n = if i == 15 { 40 } else { 20 + 7 * i };
            (p.clone(), n, generate(MODEL, p, n, &["--raw"]))
        })
        .collect();
    assert!(expected[15].2["prompt_token_ids"].as_array().unwrap().len() > 128);

    let server = Server::start(&["--max-batch", "8"]);
    std::thread::scope(|scope| {
        let handles: Vec<_> = expected
            .iter()
            .enumerate()
            .map(|(i, (prompt, n, g))| {
                let server = &server;
                scope.spawn(move || {
                    let mut body = json!({"prompt": prompt, "max_tokens": n, "temperature": 0});
                    if i % 2 == 0 {
                        let (status, reply) = server.post("/v1/completions", &body);
                        assert_eq!(status, 200, "{reply}");
                        assert_matches(&reply, g, reply["choices"][0]["text"].as_str().unwrap());
                    } else {
                        body["stream"] = json!(true);
                        body["stream_options"] = json!({"include_usage": true});
                        let events = server.stream("/v1/completions", &body);
                        let end = check_stream(&events, "text_completion");
                        assert_matches(&end, g, &streamed_text(&events));
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().expect("a request failed");
        }
    });
    // They ran together: 8 at most, the rest waited in the queue.
    let health = server.get("/health").1;
    let largest = health["largest_batch"].as_u64().unwrap();
    assert!((2..=8).contains(&largest), "{health}");
}

#[test]
fn a_client_that_leaves_mid_stream_is_dropped_and_others_are_served() {
    // Slow steps and no EOS: the stream runs 5 s at least, long after the client has gone.
    let server = Server::start_with_env(&["--max-batch", "1"], SLOW);
    let body = json!({"prompt": "ROMEO:", "max_tokens": 250, "temperature": 0, "stream": true,
                      "ignore_eos": true});
    let mut events = BufReader::new(server.open_stream("/v1/completions", &body));
    let mut first = String::new();
    events.read_line(&mut first).unwrap();
    assert!(first.starts_with("data: {"), "{first:?}");
    drop(events); // closes the connection
    assert!(
        server.wait_for_log("the client went away"),
        "the sequence was not dropped: {}",
        server.log()
    );
    // The one cache is free again: the next request runs.
    let (status, reply) = server.post(
        "/v1/completions",
        &json!({"prompt": "JULIET:", "max_tokens": 5}),
    );
    assert_eq!(status, 200, "{reply}");
}

#[test]
fn a_full_queue_answers_429() {
    // Slow steps and no EOS: each request runs 1 s at least, so the ten overlap on any host.
    let server = Server::start_with_env(&["--max-batch", "1", "--max-queue", "1"], SLOW);
    let body = json!({"prompt": "ROMEO:", "max_tokens": 50, "temperature": 0,
                      "ignore_eos": true});
    let replies: Vec<(u16, Value)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..10)
            .map(|_| scope.spawn(|| server.post("/v1/completions", &body)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let busy: Vec<_> = replies.iter().filter(|(s, _)| *s == 429).collect();
    let done = replies.iter().filter(|(s, _)| *s == 200).count();
    assert!(!busy.is_empty() && done >= 1, "{replies:?}");
    assert_eq!(busy.len() + done, replies.len(), "{replies:?}");
    assert_eq!(busy[0].1["error"]["code"], "queue_full", "{:?}", busy[0]);
    // Once the queue drains, requests are served again.
    assert_eq!(server.post("/v1/completions", &body).0, 200);
}

mod errors;
mod faults;
