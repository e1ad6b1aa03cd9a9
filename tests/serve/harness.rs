//! A `tiny-decoder serve` child process on a free loopback port, and a plain HTTP client
//! (ureq) with a timeout on every call. The server is killed when its handle drops, so a
//! failing test never leaves it running; its stderr is read all along (a full pipe would
//! block it) and kept for assertions.

use serde_json::Value;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_tiny-decoder");

/// Longest any one call may take; the tiny model answers in well under a second.
const TIMEOUT: Duration = Duration::from_secs(60);

/// The scheduler's slow fault (debug builds, as `cargo test` makes them): every step takes
/// at least 20 ms, so requests sent together overlap on any host, however fast.
pub const SLOW: &[(&str, &str)] = &[("TINY_DECODER_FAULT", "slow")];

pub struct Server {
    child: Child,
    pub url: String,
    log: Arc<Mutex<String>>,
    /// The thread that copies stderr into `log`: joined once the server exits, so that its
    /// last lines are in the log when `wait_exit` returns.
    reader: Option<std::thread::JoinHandle<()>>,
    agent: ureq::Agent,
}

impl Server {
    /// `serve --port 0` with `args`, once it prints the address it listens on.
    pub fn start(args: &[&str]) -> Server {
        Self::start_with_env(args, &[])
    }

    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut cmd = Command::new(BIN);
        cmd.args(["serve", "--port", "0"]).args(args);
        cmd.env_remove("TINY_DECODER_API_KEY");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn serve");
        let stderr = child.stderr.take().expect("stderr");
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = mpsc::channel();
        let kept = log.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(url) = line.strip_prefix("listening on ") {
                    let _ = tx.send(url.to_string());
                }
                let mut log = kept.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        });
        let agent = ureq::AgentBuilder::new().timeout(TIMEOUT).build();
        let mut server = Server {
            child,
            url: String::new(),
            log,
            reader: Some(reader),
            agent,
        };
        match rx.recv_timeout(TIMEOUT) {
            Ok(url) => server.url = url,
            Err(_) => panic!("serve {args:?} did not start: {}", server.log()),
        }
        server
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What the server printed on stderr so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Waits up to `TIMEOUT` for the log to contain `text`.
    pub fn wait_for_log(&self, text: &str) -> bool {
        let start = Instant::now();
        while start.elapsed() < TIMEOUT {
            if self.log().contains(text) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    pub fn get(&self, path: &str) -> (u16, Value) {
        reply(self.agent.get(&format!("{}{path}", self.url)).call())
    }

    /// POSTs `body` as it is (valid JSON or not), with `key` as a bearer token when given.
    pub fn post_raw(&self, path: &str, body: &str, key: Option<&str>) -> (u16, Value) {
        let mut req = self.agent.post(&format!("{}{path}", self.url));
        req = req.set("Content-Type", "application/json");
        if let Some(key) = key {
            req = req.set("Authorization", &format!("Bearer {key}"));
        }
        reply(req.send_string(body))
    }

    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.post_raw(path, &body.to_string(), None)
    }

    /// Opens a streamed request and returns its body's reader once the headers are in.
    pub fn open_stream(&self, path: &str, body: &Value) -> Box<dyn Read + Send + Sync> {
        let url = format!("{}{path}", self.url);
        let resp = match self.agent.post(&url).send_string(&body.to_string()) {
            Ok(resp) => resp,
            Err(e) => panic!("{body}: {:?}", reply(Err(e))),
        };
        assert_eq!(resp.header("Content-Type"), Some("text/event-stream"));
        resp.into_reader()
    }

    /// A streamed request's events, the `data:` payloads in order (`[DONE]` as a string).
    pub fn stream(&self, path: &str, body: &Value) -> Vec<Value> {
        let reader = BufReader::new(self.open_stream(path, body));
        let mut events = Vec::new();
        for line in reader.lines() {
            let line = line.expect("stream line");
            if let Some(data) = line.strip_prefix("data: ") {
                events.push(serde_json::from_str(data).unwrap_or(Value::String(data.into())));
            } else {
                assert!(line.is_empty(), "not an SSE data line: {line:?}");
            }
        }
        events
    }

    /// The exit status of a server that exits on its own (killed after `TIMEOUT`).
    pub fn wait_exit(&mut self) -> ExitStatus {
        let start = Instant::now();
        while start.elapsed() < TIMEOUT {
            if let Some(status) = self.child.try_wait().expect("wait") {
                if let Some(reader) = self.reader.take() {
                    let _ = reader.join();
                }
                return status;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("serve did not exit: {}", self.log());
    }

    /// SIGTERM, then the exit status (killed after `TIMEOUT`).
    pub fn terminate(&mut self) -> ExitStatus {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        self.wait_exit()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Status and JSON body of a reply, errors included (ureq returns 4xx/5xx as errors).
fn reply(r: Result<ureq::Response, ureq::Error>) -> (u16, Value) {
    let resp = match r {
        Ok(resp) => resp,
        Err(ureq::Error::Status(_, resp)) => resp,
        Err(e) => panic!("request failed: {e}"),
    };
    let status = resp.status();
    let text = resp.into_string().expect("body");
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, body)
}

/// `generate --raw -t 0 --json` (or through the chat template without `--raw`).
pub fn generate(model: &str, prompt: &str, max_tokens: usize, extra: &[&str]) -> Value {
    let n = max_tokens.to_string();
    let mut cmd = Command::new(BIN);
    cmd.args([
        "generate", "-m", model, "-p", prompt, "-t", "0", "-n", &n, "--json",
    ]);
    let out = cmd.args(extra).output().expect("run generate");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "generate {prompt:?}: {stderr}");
    serde_json::from_slice(&out.stdout).expect("generate --json")
}

/// The text of a stream's chunks, completions' `text` or chat's `delta.content`.
pub fn streamed_text(events: &[Value]) -> String {
    events
        .iter()
        .filter_map(|e| e["choices"].get(0))
        .filter_map(|c| c["text"].as_str().or(c["delta"]["content"].as_str()))
        .collect()
}

/// The finish reason OpenAI gives for `generate`'s stop reason.
pub fn finish_reason(stop_reason: &Value) -> &'static str {
    match stop_reason.as_str() {
        Some("eos") | Some("stop") => "stop",
        Some("length") => "length",
        other => panic!("unexpected stop_reason {other:?}"),
    }
}
