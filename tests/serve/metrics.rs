//! `GET /metrics` agrees with what the clients saw: requests, tokens in and out, cached
//! prompt tokens, how requests ended, and one time-to-first-token per answered request.

use super::harness::Server;
use serde_json::json;
use std::collections::HashMap;

/// The samples of a Prometheus text page, by name with labels.
fn scrape(server: &Server) -> HashMap<String, f64> {
    let resp = ureq::get(&format!("{}/metrics", server.url))
        .call()
        .expect("/metrics");
    assert!(resp.content_type().starts_with("text/plain"));
    let text = resp.into_string().unwrap();
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (name, value) = l.rsplit_once(' ').expect("name value");
            (name.to_string(), value.parse().expect("a number"))
        })
        .collect()
}

#[test]
fn metrics_count_what_the_clients_saw() {
    let server = Server::start(&["--max-batch", "2"]);
    let (mut prompt, mut cached, mut completion) = (0, 0, 0);
    let prompts = ["ROMEO:", "ROMEO: O", "JULIET:", "ROMEO: O Juliet"];
    for (i, p) in prompts.iter().enumerate() {
        let mut body = json!({"prompt": p, "max_tokens": 6 + i, "temperature": 0});
        if i % 2 == 1 {
            body["stream"] = json!(true);
            body["stream_options"] = json!({"include_usage": true});
        }
        let usage = match i % 2 {
            0 => server.post("/v1/completions", &body).1["usage"].clone(),
            _ => server
                .stream("/v1/completions", &body)
                .iter()
                .rev()
                .nth(1)
                .unwrap()["usage"]
                .clone(),
        };
        prompt += usage["prompt_tokens"].as_u64().unwrap();
        cached += usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        completion += usage["completion_tokens"].as_u64().unwrap();
    }
    // A bad request is answered before the queue: not counted as received.
    assert_eq!(
        server
            .post("/v1/completions", &json!({"prompt": "a", "n": 3}))
            .0,
        400
    );
    let m = scrape(&server);
    let get = |k: &str| *m.get(k).unwrap_or_else(|| panic!("no {k} in {m:?}"));
    assert_eq!(get("tiny_decoder_requests_received_total"), 4.0);
    let finished: f64 = [
        "stop",
        "length",
        "error",
        "abandoned",
        "cancelled",
        "timeout",
    ]
    .iter()
    .map(|r| {
        get(&format!(
            "tiny_decoder_requests_finished_total{{reason=\"{r}\"}}"
        ))
    })
    .sum();
    assert_eq!(finished, 4.0);
    assert_eq!(get("tiny_decoder_prompt_tokens_total"), prompt as f64);
    assert!(
        cached > 0,
        "a prompt extending an earlier one reuses its cache"
    );
    assert_eq!(
        get("tiny_decoder_prompt_tokens_cached_total"),
        cached as f64
    );
    assert_eq!(
        get("tiny_decoder_generation_tokens_total"),
        completion as f64
    );
    assert_eq!(get("tiny_decoder_time_to_first_token_seconds_count"), 4.0);
    assert_eq!(
        get("tiny_decoder_time_to_first_token_seconds_bucket{le=\"+Inf\"}"),
        4.0
    );
    assert_eq!(
        get("tiny_decoder_time_per_output_token_seconds_count"),
        (completion - 4) as f64
    );
    // (The gauges are stored after the step that answered: not asserted at 0 here.)
    let states = ["used", "cached", "free"];
    let blocks: f64 = (states.iter())
        .map(|s| get(&format!("tiny_decoder_kv_blocks{{state=\"{s}\"}}")))
        .sum();
    // --max-batch 2 x tiny-gqa's context of 256 positions, in blocks of 32.
    assert_eq!(blocks, 16.0, "every block is in one state");
    assert!(
        get("tiny_decoder_kv_blocks{state=\"cached\"}") > 0.0,
        "the prompts stay cached"
    );
    assert_eq!(get("tiny_decoder_requests_preempted_total"), 0.0);
    let hit = get("tiny_decoder_prefix_cache_hit_ratio");
    assert!((hit - cached as f64 / prompt as f64).abs() < 1e-9);
}
