//! `GET /metrics`: the server's counters in Prometheus' text format (version 0.0.4), named
//! as vLLM's and llama-server's are where they have one: requests, tokens in and out, the
//! prefix cache's hits, running and waiting sequences, caches used and free, and histograms
//! of time to first token, time per output token and request duration. Everything is an
//! atomic, written by the scheduler and the handlers, read at a scrape.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

/// Seconds; Prometheus' buckets are cumulative (`le`), plus `+Inf`.
const TTFT_BOUNDS: [f64; 12] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
const TOKEN_BOUNDS: [f64; 11] = [
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5,
];
const REQUEST_BOUNDS: [f64; 10] = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0];

/// A histogram of durations: a count per bucket (not cumulative until rendered), the sum
/// in microseconds.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_micros: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, secs: f64) {
        let bucket = self
            .bounds
            .iter()
            .position(|&b| secs <= b)
            .unwrap_or(self.bounds.len());
        self.counts[bucket].fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add((secs * 1e6) as u64, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut total = 0;
        for (i, count) in self.counts.iter().enumerate() {
            total += count.load(Ordering::Relaxed);
            let le = self.bounds.get(i).map_or("+Inf".into(), |b| b.to_string());
            let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {total}");
        }
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {total}");
    }
}

/// How a request ended, for `requests_finished_total{reason}`.
#[derive(Debug, Clone, Copy)]
pub enum Ended {
    Stop,
    Length,
    Error,
    Abandoned,
    Cancelled,
    TimedOut,
}

impl Ended {
    const ALL: [Ended; 6] = [
        Ended::Stop,
        Ended::Length,
        Ended::Error,
        Ended::Abandoned,
        Ended::Cancelled,
        Ended::TimedOut,
    ];

    fn label(self) -> &'static str {
        match self {
            Ended::Stop => "stop",
            Ended::Length => "length",
            Ended::Error => "error",
            Ended::Abandoned => "abandoned",
            Ended::Cancelled => "cancelled",
            Ended::TimedOut => "timeout",
        }
    }
}

/// The counters and histograms; the gauges (running, waiting, caches) are read from
/// [`super::queue::Stats`] at a scrape.
#[derive(Debug)]
pub struct Metrics {
    /// Requests queued for the scheduler.
    pub received: AtomicU64,
    /// Refused with 429: the queue was full.
    pub rejected: AtomicU64,
    finished: [AtomicU64; 6],
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens a cache already held (not prefilled).
    pub cached_tokens: AtomicU64,
    /// Requests preempted for blocks (each resumes later).
    pub preempted: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub ttft: Histogram,
    pub per_token: Histogram,
    pub request: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            received: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            finished: Default::default(),
            prompt_tokens: AtomicU64::new(0),
            cached_tokens: AtomicU64::new(0),
            preempted: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            ttft: Histogram::new(&TTFT_BOUNDS),
            per_token: Histogram::new(&TOKEN_BOUNDS),
            request: Histogram::new(&REQUEST_BOUNDS),
        }
    }
}

/// The gauges of a scrape.
pub struct Gauges {
    pub running: usize,
    pub waiting: usize,
    pub preempted: usize,
    pub blocks_used: usize,
    pub blocks_cached: usize,
    pub blocks_free: usize,
    pub cache_bytes: usize,
}

impl Metrics {
    pub fn finished(&self, how: Ended) {
        self.finished[how as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// The scrape, in Prometheus' text format.
    pub fn render(&self, g: &Gauges) -> String {
        let mut out = String::with_capacity(4096);
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut metric = |name: &str, kind: &str, help: &str, samples: &[(&str, f64)]| {
            let _ = writeln!(out, "# HELP tiny_decoder_{name} {help}");
            let _ = writeln!(out, "# TYPE tiny_decoder_{name} {kind}");
            for (labels, value) in samples {
                let _ = writeln!(out, "tiny_decoder_{name}{labels} {value}");
            }
        };
        let one = |v: u64| [("", v as f64)];
        metric(
            "requests_received_total",
            "counter",
            "Requests queued.",
            &one(load(&self.received)),
        );
        metric(
            "requests_rejected_total",
            "counter",
            "Requests refused with 429 (queue full).",
            &one(load(&self.rejected)),
        );
        let labels: Vec<String> = Ended::ALL
            .iter()
            .map(|e| format!("{{reason=\"{}\"}}", e.label()))
            .collect();
        let finished: Vec<(&str, f64)> = Ended::ALL
            .iter()
            .zip(&labels)
            .map(|(&e, l)| (l.as_str(), load(&self.finished[e as usize]) as f64))
            .collect();
        metric(
            "requests_finished_total",
            "counter",
            "Requests that left, by how they ended.",
            &finished,
        );
        let (prompt, cached) = (load(&self.prompt_tokens), load(&self.cached_tokens));
        metric(
            "prompt_tokens_total",
            "counter",
            "Prompt tokens of finished requests.",
            &one(prompt),
        );
        metric(
            "prompt_tokens_cached_total",
            "counter",
            "Prompt tokens a cache already held (not prefilled).",
            &one(cached),
        );
        metric(
            "generation_tokens_total",
            "counter",
            "Tokens generated.",
            &one(load(&self.generation_tokens)),
        );
        let hit = if prompt == 0 {
            0.0
        } else {
            cached as f64 / prompt as f64
        };
        metric(
            "prefix_cache_hit_ratio",
            "gauge",
            "Cached prompt tokens / prompt tokens, since start.",
            &[("", hit)],
        );
        metric(
            "num_requests_running",
            "gauge",
            "Sequences in the batch.",
            &[("", g.running as f64)],
        );
        metric(
            "num_requests_waiting",
            "gauge",
            "Requests queued, and preempted ones waiting to resume.",
            &[("", (g.waiting + g.preempted) as f64)],
        );
        metric(
            "requests_preempted_total",
            "counter",
            "Times a running request gave its blocks back for others (it resumes later).",
            &one(load(&self.preempted)),
        );
        metric(
            "kv_blocks",
            "gauge",
            "Blocks of the KV pool: in running requests' caches, cached prefixes, free.",
            &[
                ("{state=\"used\"}", g.blocks_used as f64),
                ("{state=\"cached\"}", g.blocks_cached as f64),
                ("{state=\"free\"}", g.blocks_free as f64),
            ],
        );
        metric(
            "kv_cache_bytes",
            "gauge",
            "Bytes of KV cache allocated.",
            &[("", g.cache_bytes as f64)],
        );
        self.ttft.render(
            &mut out,
            "tiny_decoder_time_to_first_token_seconds",
            "From queued to the first token.",
        );
        self.per_token.render(
            &mut out,
            "tiny_decoder_time_per_output_token_seconds",
            "Between consecutive tokens of a request.",
        );
        self.request.render(
            &mut out,
            "tiny_decoder_request_duration_seconds",
            "From queued to the last token.",
        );
        out
    }
}
