//! `logprobs` over HTTP: greedy log-probabilities equal the log-softmax of the model's own
//! logits for the ids it chose (a forward through the library beside the server), the
//! alternatives are the most likely tokens in order, and streamed equals whole.

use super::harness::Server;
use super::tiny_with_template;
use super::MODEL;
use candle_core::{DType, Device};
use serde_json::{json, Value};
use tiny_decoder::loader::{bundled, load_bundled};
use tiny_decoder::KvCache;

/// ln softmax of `logits`, in f64.
fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().fold(f64::MIN, |m, &l| m.max(l as f64));
    let total: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    logits
        .iter()
        .map(|&l| l as f64 - max - total.ln())
        .collect()
}

/// Greedy decoding of `n` tokens after `prompt` by the library: each id, with the
/// log-softmax of the logits it was picked from.
fn greedy(prompt: &[u32], n: usize) -> Vec<(u32, Vec<f64>)> {
    let b = bundled::find(MODEL).unwrap();
    let loaded = load_bundled(b, DType::F32, &Device::Cpu).unwrap();
    let model = &loaded.model;
    let mut cache = KvCache::new(model.config(), 256, DType::F32, &Device::Cpu).unwrap();
    let mut logits = model.next_logits(prompt, &mut cache).unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        let id = tiny_decoder::sampling::argmax(&logits);
        out.push((id, log_softmax(&logits)));
        logits = model.next_logits(&[id], &mut cache).unwrap();
    }
    out
}

/// The greedy ids of `n` tokens after `prompt`, by the library.
pub fn greedy_ids(prompt: &[u32], n: usize) -> Vec<u32> {
    greedy(prompt, n).into_iter().map(|(id, _)| id).collect()
}

#[test]
fn greedy_logprobs_equal_the_log_softmax_of_our_logits() {
    let server = Server::start(&[]);
    let prompt: Vec<u32> = vec![1, 47, 8, 120, 33, 9, 64];
    let body = json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 3,
                      "ignore_eos": true});
    let (status, reply) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{reply}");
    let lp = &reply["choices"][0]["logprobs"];
    let tokens = lp["token_logprobs"].as_array().unwrap();
    assert_eq!(tokens.len(), 12, "{reply}");
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 12);
    // The chosen ids, from the greedy reply with the ids of the alternatives: the model's
    // argmax is the first alternative, and it is the token chosen.
    let want = greedy(&prompt, 12);
    for (i, (got, (id, log_probs))) in tokens.iter().zip(&want).enumerate() {
        let got = got.as_f64().unwrap();
        let expected = log_probs[*id as usize];
        assert!(
            (got - expected).abs() < 1e-3,
            "token {i}: {got} vs {expected}"
        );
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert!(top.len() <= 3 && !top.is_empty(), "{top:?}");
        let best = top
            .values()
            .map(|v| v.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert!(
            (best - got).abs() < 1e-6,
            "greedy picks the most likely: {top:?}"
        );
    }
    let text: String = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(text, reply["choices"][0]["text"].as_str().unwrap());
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(offsets[0], 0);
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");

    // Streamed: the chunks' log-probabilities, in order, are the whole reply's.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = server.stream("/v1/completions", &streamed);
    let chunks: Vec<&Value> = events.iter().filter_map(|e| e["choices"].get(0)).collect();
    let got: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["logprobs"]["token_logprobs"].as_array())
        .flatten()
        .collect();
    // (The second request reuses the first's cached prompt: equal within rounding.)
    assert_eq!(got.len(), tokens.len());
    for (a, b) in got.iter().zip(tokens) {
        assert!(
            (a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-4,
            "{a} vs {b}"
        );
    }
    let offsets_streamed: Vec<u64> = chunks
        .iter()
        .filter_map(|c| c["logprobs"]["text_offset"].as_array())
        .flatten()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(offsets_streamed, offsets);
}

#[test]
fn chat_logprobs_in_openai_shape_whole_and_streamed() {
    let dir = tiny_with_template("smollm2", "chat-logprobs");
    let server = Server::start(&["-m", dir.to_str().unwrap()]);
    let messages = json!([{"role": "user", "content": "What light through yonder window?"}]);
    let body = json!({"messages": messages, "max_tokens": 10, "temperature": 0,
                      "logprobs": true, "top_logprobs": 2});
    let (status, reply) = server.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{reply}");
    let choice = &reply["choices"][0];
    let content = choice["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        content.len() as u64,
        reply["usage"]["completion_tokens"].as_u64().unwrap()
    );
    for entry in content {
        let bytes: Vec<u8> = entry["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        assert_eq!(
            String::from_utf8_lossy(&bytes),
            entry["token"].as_str().unwrap()
        );
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2, "{entry}");
        assert_eq!(top[0]["token"], entry["token"], "greedy: {entry}");
        assert_eq!(top[0]["logprob"], entry["logprob"]);
        assert!(top[0]["logprob"].as_f64() >= top[1]["logprob"].as_f64());
    }
    if choice["finish_reason"] == "length" {
        let text: String = content
            .iter()
            .map(|e| e["token"].as_str().unwrap())
            .collect();
        assert_eq!(text, choice["message"]["content"].as_str().unwrap());
    }
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = server.stream("/v1/chat/completions", &streamed);
    let got: Vec<Value> = events
        .iter()
        .filter_map(|e| e["choices"][0]["logprobs"]["content"].as_array())
        .flatten()
        .cloned()
        .collect();
    assert_eq!(got.len(), content.len());
    for (a, b) in got.iter().zip(content) {
        assert_eq!((&a["token"], &a["bytes"]), (&b["token"], &b["bytes"]));
        let (x, y) = (
            a["logprob"].as_f64().unwrap(),
            b["logprob"].as_f64().unwrap(),
        );
        assert!((x - y).abs() < 1e-4, "{a} vs {b}");
    }
    // Without logprobs the field is null; bad values are 400s naming the field.
    let plain = json!({"messages": messages, "max_tokens": 2});
    assert_eq!(
        server.post("/v1/chat/completions", &plain).1["choices"][0]["logprobs"],
        Value::Null
    );
    for (bad, field) in [
        (json!({"top_logprobs": 2}), "top_logprobs"),
        (
            json!({"logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
    ] {
        let mut b = plain.clone();
        b.as_object_mut()
            .unwrap()
            .extend(bad.as_object().unwrap().clone());
        let (status, err) = server.post("/v1/chat/completions", &b);
        assert_eq!(
            (status, &err["error"]["param"]),
            (400, &json!(field)),
            "{err}"
        );
    }
    let bad = json!({"prompt": "x", "logprobs": 21});
    let (status, err) = server.post("/v1/completions", &bad);
    assert_eq!(
        (status, &err["error"]["param"]),
        (400, &json!("logprobs")),
        "{err}"
    );
}
