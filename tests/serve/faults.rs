//! What the server survives: a panic in its scheduler thread, inside a model step or outside
//! one, fails the requests in flight with 500 and the next request is served; a request that
//! waits longer than `--request-timeout` for a cache is answered 408 and leaves the queue.
//! A scheduler that panics again while failing its requests exits the process with 70.
//! Clients that stall (silent connections, half-sent heads and bodies) are shed by the
//! connection cap and the header and body timeouts, and do not hold up a shutdown.
//! The faults are injected through `TINY_DECODER_FAULT`, which only debug builds read.

use super::harness::{Server, SLOW};
use serde_json::json;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

fn survives(fault: &str) {
    let server = Server::start_with_env(&["--max-batch", "2"], &[("TINY_DECODER_FAULT", fault)]);
    let body = json!({"prompt": "ROMEO:", "max_tokens": 8, "temperature": 0});
    let (status, reply) = server.post("/v1/completions", &body);
    assert_eq!(status, 500, "{fault}: {reply}");
    let message = reply["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("internal error"), "{fault}: {reply}");
    assert!(
        server.wait_for_log("scheduler restarted"),
        "{fault}: {}",
        server.log()
    );
    // The scheduler runs again, with its whole pool of caches.
    for _ in 0..3 {
        let (status, reply) = server.post("/v1/completions", &body);
        assert_eq!(status, 200, "{fault}: {reply}\n{}", server.log());
    }
    let (status, health) = server.get("/health");
    assert_eq!(status, 200, "{health}");
    assert_eq!(health["status"], "ok", "{health}");
    assert_eq!(health["scheduler_restarts"], 1, "{health}");
}

#[test]
fn a_scheduler_panic_outside_a_step_fails_its_requests_with_500_and_serving_goes_on() {
    survives("admit");
}

#[test]
fn a_scheduler_panic_inside_a_step_fails_its_requests_with_500_and_serving_goes_on() {
    survives("step");
}

#[test]
fn a_scheduler_that_cannot_recover_exits_70_for_a_supervisor_to_restart() {
    // A panic in a step, then another while failing its requests: no 503s forever.
    let mut server = Server::start_with_env(&[], &[("TINY_DECODER_FAULT", "fatal")]);
    let body = json!({"prompt": "ROMEO:", "max_tokens": 8, "temperature": 0});
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(60))
        .build();
    // The connection may be cut as the process exits: no reply is expected.
    let _ = agent
        .post(&format!("{}/v1/completions", server.url))
        .send_json(body);
    let status = server.wait_exit();
    assert_eq!(status.code(), Some(70), "{}", server.log());
    assert!(
        server.log().contains("the scheduler cannot go on"),
        "{}",
        server.log()
    );
}

#[test]
fn a_request_that_waits_past_the_timeout_is_answered_408_and_leaves_the_queue() {
    // One cache, held by a stream of 200 steps of at least 20 ms each (`slow`).
    let args = [
        "--max-batch",
        "1",
        "--max-queue",
        "1",
        "--request-timeout",
        "0.5",
    ];
    let server = Server::start_with_env(&args, SLOW);
    let long = json!({"prompt": "ROMEO:", "max_tokens": 200, "ignore_eos": true,
                      "temperature": 0, "stream": true});
    let mut running = BufReader::new(server.open_stream("/v1/completions", &long));
    let mut first = String::new();
    running.read_line(&mut first).unwrap();
    assert!(first.starts_with("data: {"), "{first:?}");

    // Whole and streamed, a waiting request gets 408 (not a stream) after about 0.5 s.
    for stream in [false, true] {
        let body = json!({"prompt": "JULIET:", "max_tokens": 4, "stream": stream});
        let start = Instant::now();
        let (status, reply) = server.post("/v1/completions", &body);
        let waited = start.elapsed();
        assert_eq!(status, 408, "stream {stream}: {reply}");
        assert_eq!(reply["error"]["code"], "request_timeout", "{reply}");
        assert!(
            waited >= Duration::from_millis(500) && waited < Duration::from_secs(3),
            "stream {stream}: answered after {waited:?}"
        );
        // It left the queue: the one place is free again for the next request, once the
        // scheduler, between two steps of the running stream, has dropped it (at once on a
        // quiet host; a loaded one may lag a step or two).
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let (_, health) = server.get("/health");
            if health["waiting"] == 0 {
                break;
            }
            assert!(Instant::now() < deadline, "still waiting: {health}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    // The running stream was not disturbed: it ends with its 200 tokens and [DONE].
    let rest: Vec<String> = running.lines().map(|l| l.unwrap()).collect();
    let last = rest.iter().rev().find(|l| !l.is_empty());
    assert_eq!(last.map(String::as_str), Some("data: [DONE]"));
    assert!(
        rest.iter()
            .any(|l| l.contains("\"finish_reason\":\"length\"")),
        "{rest:?}"
    );
    let (status, reply) = server.post("/v1/completions", &json!({"prompt": "A", "max_tokens": 2}));
    assert_eq!(status, 200, "{reply}");
}

/// A raw connection to `server` that has sent `bytes` and then stalls.
fn stalled(server: &Server, bytes: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(server.url.trim_start_matches("http://")).unwrap();
    s.write_all(bytes).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

const HALF_BODY: &[u8] = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\
    Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"";

#[test]
fn stalled_clients_are_shed_and_a_normal_client_is_served() {
    let args = [
        "--max-connections",
        "8",
        "--header-timeout",
        "1",
        "--body-timeout",
        "1",
    ];
    let server = Server::start(&args);
    // Three times the cap: silent, and half-sent heads.
    let mut held: Vec<TcpStream> = (0..24)
        .map(|i| match i % 2 {
            0 => stalled(&server, b""),
            _ => stalled(&server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"),
        })
        .collect();
    let mut body = stalled(&server, HALF_BODY);
    let start = Instant::now();
    let (status, _) = server.get("/health");
    assert_eq!(status, 200);
    let plain = json!({"prompt": "ROMEO:", "max_tokens": 2, "temperature": 0});
    assert_eq!(server.post("/v1/completions", &plain).0, 200);
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "served after {:?}",
        start.elapsed()
    );
    // The half-sent body was answered 408; the silent connections were closed.
    let mut reply = String::new();
    let _ = body.read_to_string(&mut reply);
    assert!(reply.starts_with("HTTP/1.1 408"), "{reply:?}");
    assert!(reply.contains("body_timeout"), "{reply:?}");
    let mut buf = [0u8; 64];
    assert_eq!(
        held[0].read(&mut buf).unwrap_or(0),
        0,
        "a silent connection stayed open"
    );
}

#[test]
fn sigterm_with_a_stalled_client_exits_within_the_shutdown_timeout() {
    let mut server = Server::start(&["--shutdown-timeout", "1", "--body-timeout", "600"]);
    let _body = stalled(&server, HALF_BODY);
    // Connections are accepted in order: once /health is answered the stalled one is held.
    assert_eq!(server.get("/health").0, 200);
    std::thread::sleep(Duration::from_millis(200));
    let start = Instant::now();
    let status = server.terminate();
    assert!(status.success(), "{status:?}: {}", server.log());
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "exited after {:?}",
        start.elapsed()
    );
    assert!(
        server.log().contains("--shutdown-timeout passed"),
        "{}",
        server.log()
    );
}
