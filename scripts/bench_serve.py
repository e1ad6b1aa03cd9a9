#!/usr/bin/env python3
"""Continuous batching, measured: C concurrent streams of N tokens against `tiny-decoder
serve`, for each C in --concurrency; the standard library only.

    scripts/bench_serve.py --bin target/release/tiny-decoder \\
        -m target/models/smollm2-135m-instruct --context 512 [--concurrency 1,8,32] [--tokens 128]
    scripts/bench_serve.py --url http://127.0.0.1:8080 ...   (a server already running)

Every request streams `--tokens` tokens (`ignore_eos`, so none stops early) after its own
short prompt. Per round: wall time, aggregate completion tok/s (all tokens over the wall
time, prefill included), the median stream's decode tok/s (after its first token), time to
first token p50/p99, and failures (every request must be answered in full). The last line
is the aggregate of the largest C that is at most --max-batch, over that of C = 1.
"""

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

PROMPTS = ["Once upon a time", "The history of Rome", "In a small village", "Dear diary,",
           "The recipe calls for", "Chapter one:", "The weather today", "Scientists found"]


def stream_one(url, i, tokens, out):
    """One streamed completion; fills out[i] with its timings or its error."""
    u = urlparse(url)
    body = json.dumps({"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": tokens,
                       "temperature": 0.8, "seed": i, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}})
    start = time.perf_counter()
    first, usage = None, None
    try:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            out[i] = {"error": f"{resp.status} {resp.read()[:200]!r}"}
            return
        for line in resp:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out[i] = {"error": chunk["error"]["message"]}
                return
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter()
        end = time.perf_counter()
        done = usage["completion_tokens"] if usage else 0
        if done != tokens:
            out[i] = {"error": f"{done} of {tokens} tokens"}
            return
        out[i] = {"start": start, "first": first or end, "end": end, "tokens": done}
    except Exception as e:  # any failure is counted, not raised
        out[i] = {"error": f"{type(e).__name__}: {e}"}


def percentile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def round_of(url, c, tokens):
    out = [None] * c
    threads = [threading.Thread(target=stream_one, args=(url, i, tokens, out)) for i in range(c)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in out if r and "error" not in r]
    errors = [r["error"] for r in out if not r or "error" in r]
    ttft = [r["first"] - r["start"] for r in ok] or [0.0]
    decode = [(r["tokens"] - 1) / max(r["end"] - r["first"], 1e-9) for r in ok] or [0.0]
    return {"concurrency": c, "wall_s": wall, "answered": len(ok), "failed": len(errors),
            "errors": errors[:3],
            "aggregate_tokens_per_s": sum(r["tokens"] for r in ok) / wall,
            "median_stream_decode_tokens_per_s": statistics.median(decode),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99)}


def start_server(args):
    cmd = [args.bin, "serve", "--port", "0", "--max-batch", str(args.max_batch),
           "--max-queue", "256"]
    if args.context:
        cmd += ["--context", str(args.context)]
    if args.model:
        cmd += ["-m", args.model]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    for line in proc.stderr:
        print(line.rstrip(), file=sys.stderr)
        if line.startswith("listening on "):
            # Keep draining stderr (one line per request) so the server never blocks on it.
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, line.split()[-1]
    raise RuntimeError("serve did not start")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server (else --bin starts one)")
    ap.add_argument("--bin", default="target/release/tiny-decoder")
    ap.add_argument("-m", "--model")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--context", type=int, help="serve's --context (smaller caches)")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    proc, url = (None, args.url) if args.url else start_server(args)
    try:
        stream_one(url, 0, 4, [None])  # warm up: first-touch of the weights and caches
        rounds = [round_of(url, int(c), args.tokens) for c in args.concurrency.split(",")]
    finally:
        if proc:
            proc.terminate()
            proc.wait()
    for r in rounds:
        print(json.dumps(r) if args.json else
              f"{r['concurrency']:>3} streams: {r['answered']} answered, {r['failed']} failed | "
              f"aggregate {r['aggregate_tokens_per_s']:.1f} tok/s | per stream "
              f"{r['median_stream_decode_tokens_per_s']:.1f} tok/s | TTFT p50 "
              f"{r['ttft_p50_s']:.2f} s, p99 {r['ttft_p99_s']:.2f} s | wall {r['wall_s']:.1f} s")
    one = next((r for r in rounds if r["concurrency"] == 1), None)
    batched = [r for r in rounds if 1 < r["concurrency"] <= args.max_batch]
    if one and batched:
        b = batched[-1]
        ratio = b["aggregate_tokens_per_s"] / one["aggregate_tokens_per_s"]
        print(f"aggregate with {b['concurrency']} streams / one stream: {ratio:.2f}x")
    return 1 if any(r["failed"] for r in rounds) else 0


if __name__ == "__main__":
    sys.exit(main())
