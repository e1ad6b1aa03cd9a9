#!/usr/bin/env python3
"""Continuous batching, measured through the HTTP API: `tiny-decoder serve` against itself.

Starts `serve` (port 0, the port read from its stderr) and streams /v1/completions requests
of N new tokens (greedy, on prompts that ask for long answers, with `ignore_eos` since the
raw prompts often draw an EOS at once; a request that ends before N tokens is counted as
`short`) in rounds that alternate:

  single:   one request alone                      -> its decode tok/s
  batch:    `--streams` (8) requests at once        -> aggregate decode tok/s
  burst:    `--burst` (32) requests at once          -> every one answered, TTFT p50/p99
  masked:   with `--constrained`, the batch under a JSON-schema response_format whose
            replies outrun `--tokens`               -> masked / free aggregate (its cost)

A request's decode tok/s is (completion tokens - 1) / (time of last chunk - time of first
chunk); the aggregate is all completion tokens after each one's first, over the span from the
first first-chunk to the last last-chunk. Medians over `--rounds`. Python stdlib only.

usage:
  scripts/bench_serve.py [--model target/models/smollm2-135m-instruct] [--dtype f32]
      [--tokens 128] [--streams 8] [--burst 32] [--rounds 3] [--max-batch 8] [--constrained]
Writes target/bench_serve-DATE.json and prints a markdown table.
"""
import argparse
import datetime
import http.client
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = os.environ.get("TINY_DECODER_BIN", os.path.join(ROOT, "target", "release", "tiny-decoder"))
PROMPTS = [
    "Write a long story about a lighthouse keeper who finds a map.",
    "Explain in detail how a steam engine works, step by step.",
    "Describe a walk through a busy market in the morning.",
    "Write a letter to a friend about a journey across the mountains.",
    "Tell the history of the bicycle in many paragraphs.",
    "Describe how bread is made, from the field to the table.",
    "Write a long poem about the sea and the people who sail on it.",
    "Explain why the sky changes colour at sunset, in detail.",
]


def start_server(args):
    cmd = [OURS, "serve", "-m", args.model, "--port", "0", "--max-batch", str(args.max_batch),
           "--max-queue", str(max(64, args.burst * 2))]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    lines = []
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"(127\.0\.0\.1|localhost|0\.0\.0\.0):(\d+)", line)
        if m:
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, int(m.group(2)), "".join(lines)
    proc.kill()
    sys.exit("serve did not report its address:\n" + "".join(lines))


MODEL = None  # the id /v1/models lists


# `--constrained`: a response_format whose replies run past any --tokens (at least 1000
# strings), so that a masked batch decodes as many tokens as a free one.
LONG_JSON = {"type": "json_schema", "json_schema": {"name": "lines", "schema": {
    "type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1000}}}


def stream(port, prompt, tokens, out, extra=None):
    """One streamed completion; appends {ttft, first, last, tokens, finish} to out."""
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": tokens,
                       "temperature": 0, "stream": True, "ignore_eos": True,
                       "stream_options": {"include_usage": True}, **(extra or {})})
    start = time.time()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        out.append({"error": resp.status})
        return
    first = last = None
    chunks, finish, usage = 0, None, None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        msg = json.loads(line[6:])
        if msg.get("usage"):
            usage = msg["usage"]
        for c in msg.get("choices", []):
            if c.get("text"):
                now = time.time()
                first = first or now
                last = now
                chunks += 1
            finish = c.get("finish_reason") or finish
    n = usage["completion_tokens"] if usage else chunks
    out.append({"ttft": (first or time.time()) - start, "first": first, "last": last,
                "tokens": n, "finish": finish})


def run_round(port, count, tokens, extra=None):
    out, threads = [], []
    for i in range(count):
        t = threading.Thread(target=stream,
                             args=(port, PROMPTS[i % len(PROMPTS)], tokens, out, extra))
        threads.append(t)
        t.start()
    for t in threads:
        t.join()
    ok = [r for r in out if "error" not in r and r["first"]]
    if not ok:
        return {"answered": 0, "requests": count}
    span = max(r["last"] for r in ok) - min(r["first"] for r in ok)
    decoded = sum(r["tokens"] - 1 for r in ok)
    ttfts = sorted(r["ttft"] for r in ok)
    p99 = ttfts[min(len(ttfts) - 1, int(round(0.99 * (len(ttfts) - 1))))]
    return {"requests": count, "answered": len(ok),
            "errors": [r["error"] for r in out if "error" in r],
            "short": sum(1 for r in ok if r["finish"] != "length"),
            "aggregate_tok_s": decoded / span if span > 0 else 0.0,
            "per_stream_tok_s": statistics.median(
                (r["tokens"] - 1) / max(r["last"] - r["first"], 1e-9) for r in ok),
            "ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": p99}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(ROOT, "target/models/smollm2-135m-instruct"))
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--burst", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--constrained", action="store_true",
                    help="also run the batch under a JSON-schema response_format (masking cost)")
    args = ap.parse_args()
    global MODEL
    proc, port, banner = start_server(args)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("GET", "/v1/models")
        MODEL = json.loads(conn.getresponse().read())["data"][0]["id"]
        run_round(port, 1, 8)  # warm-up
        rounds = []
        for r in range(args.rounds):
            cases = [("single", 1), ("batch", args.streams)]
            if r % 2:
                cases.reverse()
            if args.constrained:
                cases.insert(1 if r % 2 else 2, ("masked", args.streams))
            extra = {"masked": {"response_format": LONG_JSON}}
            got = {name: run_round(port, n, args.tokens, extra.get(name)) for name, n in cases}
            got["burst"] = run_round(port, args.burst, args.tokens)
            rounds.append(got)
            print(f"round {r + 1}: " + json.dumps(got), file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    med = lambda case, key: statistics.median(r[case][key] for r in rounds)
    single, batch = med("single", "aggregate_tok_s"), med("batch", "aggregate_tok_s")
    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform.processor() or platform.machine(),
        "cpu": open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(": ")
        if os.path.exists("/proc/cpuinfo") else "",
        "model": args.model, "dtype": args.dtype or "auto", "tokens": args.tokens,
        "streams": args.streams, "burst": args.burst, "max_batch": args.max_batch,
        "rounds": rounds,
        "single_tok_s": single, "batch_aggregate_tok_s": batch,
        "batch_per_stream_tok_s": med("batch", "per_stream_tok_s"),
        "ratio": batch / single if single else 0.0,
        "burst_answered": min(r["burst"]["answered"] for r in rounds),
        "burst_ttft_p99_s": med("burst", "ttft_p99_s"),
        "burst_ttft_p50_s": med("burst", "ttft_p50_s"),
    }
    if args.constrained:
        masked = med("masked", "aggregate_tok_s")
        report["masked_batch_aggregate_tok_s"] = masked
        report["masked_over_free"] = masked / batch if batch else 0.0
    os.makedirs(os.path.join(ROOT, "target"), exist_ok=True)
    path = os.path.join(ROOT, "target", f"bench_serve-{datetime.date.today():%Y%m%d}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"| one stream | {args.streams} streams: aggregate (per stream) | ratio "
          f"| {args.burst} at once: answered, TTFT p50 / p99 |")
    print("|---|---|---|---|")
    print(f"| {single:.1f} tok/s | {batch:.1f} ({report['batch_per_stream_tok_s']:.1f}) tok/s "
          f"| {report['ratio']:.2f}x | {report['burst_answered']}/{args.burst}, "
          f"{report['burst_ttft_p50_s']:.2f} s / {report['burst_ttft_p99_s']:.2f} s |")
    if args.constrained:
        print(f"\n{args.streams} streams under a JSON schema: {report['masked_batch_aggregate_tok_s']:.1f}"
              f" tok/s aggregate, {report['masked_over_free']:.3f}x the free batch")
    print(f"written {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
