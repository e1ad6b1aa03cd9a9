//! Prefix reuse across requests: a prompt that begins with what the KV pool holds (the turn
//! before of the same conversation, every token of it; a running request's prompt, in whole
//! blocks of 32 positions) prefills only the rest, reports it as
//! `prompt_tokens_details.cached_tokens`, and answers as if nothing were cached.

use super::harness::{Server, SLOW};
use super::logprobs::greedy_ids;
use super::tiny_with_template;
use serde_json::{json, Value};

fn completion_ids(server: &Server, prompt: &[u32], n: usize) -> (Vec<u32>, Value) {
    let body = json!({"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 0,
                      "ignore_eos": true});
    let (status, reply) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{reply}");
    // The ids, from the library's greedy run: the reply's text must be theirs.
    let ids = greedy_ids(prompt, n);
    (ids, reply["usage"].clone())
}

#[test]
fn a_prompt_that_extends_a_finished_one_reuses_its_cache_and_answers_the_same() {
    let server = Server::start(&["--max-batch", "2"]);
    let first: Vec<u32> = (0..40).map(|i| 3 + (i * 7 % 200)).collect();
    let (ids, usage) = completion_ids(&server, &first, 10);
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"], 0,
        "{usage}"
    );
    // The next turn: the first prompt, its answer, and more.
    let mut second = first.clone();
    second.extend(&ids);
    second.extend([5, 6, 7, 8]);
    let body = json!({"prompt": second, "max_tokens": 12, "temperature": 0, "ignore_eos": true});
    let (status, reply) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{reply}");
    // The cache held the prompt and the answer but its last token (never fed).
    let cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(cached, (first.len() + ids.len() - 1) as u64, "{reply}");
    // Equal to the same prompt run from nothing, in a fresh server.
    let fresh = Server::start(&[]);
    let (_, uncached) = fresh.post("/v1/completions", &body);
    assert_eq!(
        uncached["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );
    assert_eq!(reply["choices"][0]["text"], uncached["choices"][0]["text"]);
    // A prompt sharing nothing takes the other cache, which held nothing.
    let other: Vec<u32> = (0..30).map(|i| 300 + i).collect();
    let (_, usage) = completion_ids(&server, &other, 4);
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"], 0,
        "{usage}"
    );
    // And the conversation's cache is still there for its next turn.
    let (status, again) = server.post("/v1/completions", &body);
    assert_eq!(status, 200);
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
        second.len() as u64 - 1
    );
    assert_eq!(again["choices"][0]["text"], reply["choices"][0]["text"]);
}

#[test]
fn a_chat_prefills_only_its_new_turn() {
    let dir = tiny_with_template("smollm2", "chat-prefix");
    let server = Server::start(&["-m", dir.to_str().unwrap(), "--max-batch", "2"]);
    let mut messages = vec![json!({"role": "system", "content": "You are a bard."})];
    let mut prefilled = Vec::new();
    for turn in 0..4 {
        messages.push(json!({"role": "user", "content": format!("Verse {turn}?")}));
        let body = json!({"messages": messages, "max_tokens": 6, "temperature": 0});
        let (status, reply) = server.post("/v1/chat/completions", &body);
        assert_eq!(status, 200, "{reply}");
        let usage = &reply["usage"];
        let prompt = usage["prompt_tokens"].as_u64().unwrap();
        let cached = usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        prefilled.push(prompt - cached);
        let content = reply["choices"][0]["message"]["content"].clone();
        messages.push(json!({"role": "assistant", "content": content}));
    }
    // Turn 1 prefills everything; later turns their new message and the template's markup
    // around it (and the answer's last token, and any tokens that re-encode differently).
    // (Here 64, then 46 a turn while the prompt grows 64 -> 217.)
    let later = &prefilled[1..];
    let (min, max) = (later.iter().min().unwrap(), later.iter().max().unwrap());
    assert!(
        *max < prefilled[0] && max - min <= 4,
        "prefilled per turn: {prefilled:?}"
    );
}

#[test]
fn a_prompt_sharing_a_running_requests_prefix_shares_its_blocks_and_answers_the_same() {
    // A running sequence offers each block as it fills: the second request must arrive
    // before the first fills its fifth (positions 128..160: 27 tokens after its 133-token
    // prompt). Every step takes at least 20 ms here (the scheduler's slow fault), so that is
    // half a second away on any host; a fast host once finished the whole first request
    // before the second arrived.
    let server = Server::start_with_env(&["--max-batch", "2"], SLOW);
    let shared: Vec<u32> = (0..130).map(|i| 3 + (i * 11 % 500)).collect();
    let mut first = shared.clone();
    first.extend([7, 8, 9]);
    let body = json!({"prompt": first, "max_tokens": 90, "temperature": 0, "stream": true,
                      "ignore_eos": true});
    // The first request runs: once its first chunk is out, its whole prompt is cached.
    let mut stream = std::io::BufReader::new(server.open_stream("/v1/completions", &body));
    let mut line = String::new();
    while !line.starts_with("data: {") {
        line.clear();
        let read = std::io::BufRead::read_line(&mut stream, &mut line).unwrap();
        assert!(read > 0, "the stream ended before its first chunk");
    }
    let mut second = shared.clone();
    second.extend([40, 41, 42, 43]);
    let body = json!({"prompt": second, "max_tokens": 12, "temperature": 0, "ignore_eos": true});
    let (status, reply) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{reply}");
    // The whole blocks the running request filled of the shared 130 positions: 4 of 32.
    let cached = &reply["usage"]["prompt_tokens_details"]["cached_tokens"];
    assert_eq!(cached, shared.len() / 32 * 32, "{reply}");
    let fresh = Server::start(&[]);
    let (_, uncached) = fresh.post("/v1/completions", &body);
    assert_eq!(reply["choices"][0]["text"], uncached["choices"][0]["text"]);
    drop(stream);
}

#[test]
fn requests_arriving_together_with_one_system_prompt_prefill_it_once() {
    let server = Server::start(&["--max-batch", "4"]);
    let shared: Vec<u32> = (0..200).map(|i| 5 + (i * 13 % 600)).collect();
    let replies: Vec<serde_json::Value> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..4u32)
            .map(|i| {
                let mut prompt = shared.clone();
                prompt.extend([30 + i, 31 + i, 32 + i]);
                let server = &server;
                scope.spawn(move || {
                    let body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0});
                    server.post("/v1/completions", &body).1
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let cached: Vec<u64> = replies
        .iter()
        .map(|r| {
            r["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
        })
        .collect();
    // One prefilled the system prompt; the others waited for it and took its whole blocks.
    let blocks = (shared.len() / 32 * 32) as u64;
    let prefilled_it = cached.iter().filter(|&&c| c < blocks).count();
    assert_eq!(prefilled_it, 1, "cached tokens per request: {cached:?}");
}

#[test]
fn a_new_conversation_reuses_a_shared_opening_without_cutting_a_cached_one() {
    let server = Server::start(&["--max-batch", "2"]);
    // A conversation's turn, cached when it ends.
    let first: Vec<u32> = (0..120).map(|i| 3 + (i * 7 % 300)).collect();
    let (ids, _) = completion_ids(&server, &first, 6);
    // Another conversation with the same opening tokens (a chat template's), then more.
    let mut other = first[..10].to_vec();
    other.extend((0..40).map(|i| 400 + i));
    let (_, usage) = completion_ids(&server, &other, 4);
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"], 10,
        "{usage}"
    );
    // It wrote into a copy of the block it shared: the first conversation's next turn
    // still finds all of it.
    let mut next = first.clone();
    next.extend(&ids);
    next.extend([9, 10]);
    let body = json!({"prompt": next, "max_tokens": 2, "temperature": 0});
    let (_, reply) = server.post("/v1/completions", &body);
    let cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(cached, (first.len() + ids.len() - 1) as u64, "{reply}");
}
