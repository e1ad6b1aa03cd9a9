//! The paged KV pool: more requests run at once than `--context`-sized caches would fit in
//! the same memory, and when the pool runs short the requests admitted last are preempted
//! (their blocks given back) and recomputed later, answering exactly as they would alone.

use super::harness::{Server, SLOW};
use serde_json::{json, Value};

/// tiny-gqa's K/V: 2,048 bytes a token, 65,536 a block of 32 positions.
const BLOCK_BYTES: usize = 65_536;

fn prompt(i: u32, n: u32) -> Vec<u32> {
    (0..n).map(|j| 3 + (i * 977 + j * 31) % 500).collect()
}

/// Sends every body at once; the replies in order.
fn all_at_once(server: &Server, bodies: &[Value]) -> Vec<Value> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = (bodies.iter())
            .map(|body| scope.spawn(move || server.post("/v1/completions", body)))
            .collect();
        (handles.into_iter())
            .map(|h| {
                let (status, reply) = h.join().unwrap();
                assert_eq!(status, 200, "{reply}");
                reply
            })
            .collect()
    })
}

#[test]
fn short_requests_run_more_at_once_than_fixed_caches_would_fit() {
    // Two caches' worth of --context 256: 16 blocks. Eight requests of 40 + 8 tokens need
    // two blocks each, so all eight run together.
    let memory = (16 * BLOCK_BYTES).to_string();
    // Every step takes at least 20 ms (the scheduler's slow fault), so the eight arrive
    // within a step or two of each other on any host, not one after another's end.
    let server = Server::start_with_env(&["--kv-memory", &memory, "--max-batch", "8"], SLOW);
    let bodies: Vec<Value> = (0..8)
        .map(|i| {
            json!({"prompt": prompt(i, 40), "max_tokens": 8, "temperature": 0,
                         "ignore_eos": true})
        })
        .collect();
    let replies = all_at_once(&server, &bodies);
    let (_, health) = server.get("/health");
    let largest = health["largest_batch"].as_u64().unwrap();
    assert!(largest > 2, "at most {largest} ran at once: {health}");
    // Each answers as it does alone.
    for (body, reply) in bodies.iter().zip(&replies) {
        let (_, alone) = server.post("/v1/completions", body);
        assert_eq!(alone["choices"][0]["text"], reply["choices"][0]["text"]);
    }
}

/// One --context of 256 positions: 8 blocks. Four requests of 40 + 100 tokens need 5 blocks
/// each: they start together, and as they grow the last admitted give their blocks back;
/// each resumes from its own blocks, still cached, copying or taking back its last one. For
/// tiny-gqa's K/V, MQA's (one head: a block is one run of the pool) and an MLA latent.
#[test]
fn requests_preempted_for_blocks_resume_and_answer_as_alone() {
    let forms: [(&[&str], usize); 3] = [
        (&[], BLOCK_BYTES),
        (&["--attention", "mqa"], BLOCK_BYTES / 2),
        // Rows of 48 + 32 values, 4 layers, f32.
        (&["--attention", "mla:48,rope=32"], 32 * 80 * 4 * 4),
    ];
    for (attention, block_bytes) in forms {
        preempted(attention, &(8 * block_bytes).to_string());
    }
}

fn preempted(attention: &[&str], memory: &str) {
    let args = [attention, &["--kv-memory", memory, "--max-batch", "4"]].concat();
    // Slow steps (20 ms at least): the four overlap enough to run out of blocks on any host.
    let server = Server::start_with_env(&args, SLOW);
    let bodies: Vec<Value> = (0..4)
        .map(|i| {
            json!({"prompt": prompt(i, 40), "max_tokens": 100, "temperature": 0,
                         "ignore_eos": true})
        })
        .collect();
    let replies = all_at_once(&server, &bodies);
    let metrics = ureq::get(&format!("{}/metrics", server.url))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    let preempted: f64 = (metrics.lines())
        .find_map(|l| l.strip_prefix("tiny_decoder_requests_preempted_total "))
        .expect("the preemption counter")
        .parse()
        .unwrap();
    assert!(preempted > 0.0, "{args:?}: {metrics}");
    let alone = Server::start(attention);
    for (body, reply) in bodies.iter().zip(&replies) {
        assert_eq!(reply["usage"]["completion_tokens"], 100, "{reply}");
        let (_, want) = alone.post("/v1/completions", body);
        assert_eq!(
            want["choices"][0]["text"], reply["choices"][0]["text"],
            "{args:?}"
        );
    }
}
