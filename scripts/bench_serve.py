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

  pool:     with `--pool`, instead of the rounds: a soak of the KV pool. `serve --max-batch 64
            --context C --max-queue 256 [--kv-memory BYTES]`; every request is a streamed, greedy
            /v1/chat/completions whose system message is the same ~3000-token handbook (sized
            with the server's usage.prompt_tokens) and whose user message is one of 16
            questions. One warm-up request per question, alone, gives the references; then
            `--clients` (64) threads loop for `--duration` (120) s, each request cut on
            purpose (connection closed) after 1-5 content chunks with probability 0.25. Checks
            (PASS/FAIL, exit 1 on any FAIL): no request lost (every uncut one got 200 and a
            finish_reason, no 429), none mixed (at most 5% of completed replies differ from
            their reference), memory flat (server VmRSS, median of the last 20% of 1 s samples
            within 10% of the first 20%), /metrics consistent (requests_finished_total's delta
            = requests sent, generation_tokens_total's delta >= the completion tokens the
            clients got), and, when serve's stderr names its `KV pool: B bytes, N blocks of P
            positions`, more sequences at once (peak num_requests_running, /metrics polled
            every 0.5 s) than fixed slots of C positions would fit in B bytes.

  long:     with `--long P`, instead of the rounds: `--streams` (16) requests at once, each with
            its own ~P-token prompt (no two share a block), on `--model` and every `--compare`
            model (each its own `serve --max-batch --context`, kept up together). Per model, a
            cold round first (every prompt prefilled, 128 tokens a step while the others
            decode: its wall time, until every stream is answered, is reported), then `--rounds`
            warm rounds, alternating between the models, of the same prompts: their blocks are
            cached by then, so the streams decode together over P positions each (the
            aggregate of many long-context sequences, where a smaller KV cache should pay).

usage:
  scripts/bench_serve.py [--model target/models/smollm2-135m-instruct] [--dtype f32]
      [--tokens 128] [--streams 8] [--burst 32] [--rounds 3] [--max-batch 8] [--constrained]
  scripts/bench_serve.py --long 3000 --model A --compare B [--compare C] [--dtype bf16]
      [--streams 16] [--max-batch 16] [--tokens 64] [--context P+tokens+64] [--rounds 3]
  scripts/bench_serve.py --pool [--clients 64] [--duration 120] [--context 3300] [--tokens 32]
      [--kv-memory BYTES] [--max-batch 64]
Writes target/bench_serve-DATE.json (with --pool, target/bench_serve_pool-DATE.json) and prints
a markdown table.
"""
import argparse
import datetime
import http.client
import json
import os
import platform
import random
import re
import socket
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


def start_server(args, queue=None, extra=()):
    cmd = [OURS, "serve", "-m", args.model, "--port", "0", "--max-batch", str(args.max_batch),
           "--max-queue", str(queue or max(64, args.burst * 2)), *extra]
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
            proc.log = []  # what it writes on stderr later
            threading.Thread(target=lambda: proc.log.extend(proc.stderr), daemon=True).start()
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


def run_round(port, count, tokens, extra=None, prompts=PROMPTS):
    out, threads = [], []
    for i in range(count):
        t = threading.Thread(target=stream,
                             args=(port, prompts[i % len(prompts)], tokens, out, extra))
        threads.append(t)
        t.start()
    for t in threads:
        t.join()
    ok = [r for r in out if "error" not in r and r["first"]]
    if not ok:
        return {"answered": 0, "requests": count, "short": 0, "aggregate_tok_s": 0.0,
                "errors": [r.get("error") for r in out]}
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


# `--pool`: a made-up handbook as the shared system prompt, and questions about it.
HANDBOOK_SUBJECTS = [
    "Every new employee", "The night shift supervisor", "A visiting customer", "The finance team",
    "Each warehouse lead", "The safety officer", "A delivery driver", "The design studio",
    "Any contractor on site", "The customer support desk", "The glassblowing workshop",
    "A team of more than five people", "The quality inspector", "The head of purchasing"]
HANDBOOK_ACTIONS = [
    "must sign the visitor book before", "is expected to report any broken lantern glass after",
    "should request written approval for overtime before", "may borrow a company bicycle during",
    "has to wear the blue safety apron during", "keeps a paper copy of the shipping log until",
    "reviews the weekly brass and copper orders before", "locks the kiln room door after",
    "answers every letter from a lighthouse client within two days of",
    "files travel expenses on the green form no later than",
    "tests each oil reservoir for leaks before", "writes the batch number on the crate at"]
HANDBOOK_TIMES = [
    "the Monday morning stand-up", "the end of each quarter", "the annual lantern fair",
    "any trip to the harbour depot", "the spring inventory count", "a fire drill",
    "the first frost of the winter", "the closing of the loading bay at six in the evening",
    "a visit from the harbour master", "the monthly town hall in the canteen",
    "the arrival of a new shipment of glass", "the summer holiday shutdown"]
HANDBOOK_TOPICS = ["Working hours", "Safety in the workshop", "Travel and expenses", "Customers",
                   "The warehouse", "Holidays and leave", "Quality", "Purchasing"]
QUESTIONS = [
    "What is the name of the company?", "When must the visitor book be signed?",
    "Who wears the blue safety apron?", "How do I file travel expenses?",
    "What happens at the annual lantern fair?", "Can I borrow a company bicycle?",
    "Who locks the kiln room door?", "How fast must letters from lighthouse clients be answered?",
    "What should I do with broken lantern glass?", "When is the spring inventory count?",
    "Who reviews the brass and copper orders?", "What is written on each crate?",
    "Summarise the section on working hours.", "What does the safety officer do?",
    "Is overtime allowed without approval?", "When does the loading bay close?"]


def handbook(n):
    """n sentences of the Northwind Lanterns handbook, in sections of 12; always the same text."""
    a, b, c = len(HANDBOOK_SUBJECTS), len(HANDBOOK_ACTIONS), len(HANDBOOK_TIMES)
    out = ["You are the assistant of Northwind Lanterns Ltd. Answer questions about its employee "
           "handbook briefly. The handbook follows."]
    for i in range(n):
        if i % 12 == 0:
            out.append(f"\n\nSection {i // 12 + 1}: {HANDBOOK_TOPICS[i // 12 % len(HANDBOOK_TOPICS)]}.")
        out.append(f"{HANDBOOK_SUBJECTS[i % a]} {HANDBOOK_ACTIONS[i * 5 % b]} "
                   f"{HANDBOOK_TIMES[i * 7 % c]}.")
    return " ".join(out)


def chat(port, system, question, tokens, cut=0):
    """One streamed, greedy chat completion; with cut > 0, closes the connection after `cut`
    content chunks (if it has not finished by then). Returns what came back."""
    body = json.dumps({"model": MODEL, "max_tokens": tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True},
                       "messages": [{"role": "system", "content": system},
                                    {"role": "user", "content": question}]})
    rec = {"status": None, "text": "", "finish": None, "usage": None, "ttft": None, "chunks": 0,
           "cut": False, "error": None}
    start = time.time()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        sock = conn.sock
        resp = conn.getresponse()
        rec["status"] = resp.status
        if resp.status != 200:
            rec["error"] = resp.read()[:300].decode(errors="replace")
            return rec
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[6:])
            rec["usage"] = msg.get("usage") or rec["usage"]
            for c in msg.get("choices", []):
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    rec["ttft"] = rec["ttft"] or time.time() - start
                    rec["text"] += piece
                    rec["chunks"] += 1
                rec["finish"] = c.get("finish_reason") or rec["finish"]
            if cut and rec["chunks"] >= cut and not rec["finish"]:
                sock.shutdown(socket.SHUT_RDWR)  # a client that goes away mid-stream
                rec["cut"] = True
                break
    except (OSError, http.client.HTTPException, ValueError) as e:
        rec["error"] = repr(e)
    finally:
        conn.close()
    return rec


def metrics(port):
    """GET /metrics as {'name{labels}': value}."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return {k: float(v) for k, _, v in (l.rpartition(" ") for l in text.splitlines()
                                        if l and not l.startswith("#"))}


def finished(m):
    return sum(v for k, v in m.items() if k.startswith("tiny_decoder_requests_finished_total"))


def every(period, fn, stop):
    """Calls fn() every `period` seconds on a thread until `stop` is set."""
    def loop():
        while not stop.wait(period):
            try:
                fn()
            except (OSError, http.client.HTTPException, ValueError):
                pass
    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


WATCH = ["tiny_decoder_num_requests_running", 'tiny_decoder_kv_blocks{state="used"}',
         'tiny_decoder_kv_blocks{state="cached"}', 'tiny_decoder_kv_blocks{state="free"}',
         "tiny_decoder_requests_preempted_total"]


def pool(args):
    global MODEL
    extra = ["--context", str(args.context)]
    if args.kv_memory:
        extra += ["--kv-memory", args.kv_memory]
    proc, port, banner = start_server(args, queue=256, extra=extra)
    print(banner.strip(), file=sys.stderr)
    kv = re.search(r"KV pool: (\d+) bytes, (\d+) blocks of (\d+) positions", banner)
    if kv:
        pool_bytes, blocks, per_block = map(int, kv.groups())
        per_token = pool_bytes / (blocks * per_block)
    else:  # the fixed caches of the server before the pool: informational only
        old = re.search(r"KV caches: (\d+) bytes", banner)
        tok = re.search(r"(\d+) bytes per token", banner)
        pool_bytes = int(old.group(1)) if old else None
        per_token = int(tok.group(1)) if tok else None
    slots = int(pool_bytes // (args.context * per_token)) if pool_bytes and per_token else None
    print(f"KV pool line: {kv.group(0) if kv else 'absent'}; fixed slots of {args.context} "
          f"positions in {pool_bytes} bytes: {slots}")
    rss, peak, low, stop = [], {}, {}, threading.Event()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("GET", "/v1/models")
        MODEL = json.loads(conn.getresponse().read())["data"][0]["id"]
        # Size the handbook to ~3000 tokens (leaving room for the question and the reply).
        target = min(3000, args.context - args.tokens - 64)
        n = 120  # about 20 tokens a sentence
        for _ in range(2):
            r = chat(port, handbook(n), QUESTIONS[0], 1)
            if not r["usage"]:
                sys.exit(f"sizing request failed: {r}")
            n = max(1, int(n * target / r["usage"]["prompt_tokens"]))
        system = handbook(n)
        refs = [chat(port, system, q, args.tokens) for q in QUESTIONS]
        bad = [r for r in refs if r["status"] != 200 or not r["finish"] or not r["usage"]]
        if bad:
            sys.exit(f"warm-up failed: {bad[0]}")
        print(f"system prompt: {len(system)} chars, {refs[0]['usage']['prompt_tokens']} prompt "
              f"tokens with the first question; warm-up cached tokens: "
              f"{[(r['usage'].get('prompt_tokens_details') or {}).get('cached_tokens') for r in refs]}")

        def poll():
            m = metrics(port)
            for k in WATCH:
                if k in m:
                    peak[k], low[k] = max(peak.get(k, m[k]), m[k]), min(low.get(k, m[k]), m[k])

        def sample():
            with open(f"/proc/{proc.pid}/status") as f:
                rss.append(int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) * 1024)

        before = metrics(port)
        sample()
        threads = [every(0.5, poll, stop), every(1.0, sample, stop)]
        recs, start = [], time.time()
        deadline = start + args.duration

        def client(i):
            rng = random.Random(i)
            while time.time() < deadline:
                q = rng.randrange(len(QUESTIONS))
                cut = rng.randint(1, 5) if rng.random() < 0.25 else 0
                recs.append({**chat(port, system, QUESTIONS[q], args.tokens, cut), "q": q})
        clients = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        span = time.time() - start
        stop.set()
        for t in threads:
            t.join()
        for _ in range(120):  # cut requests may end a little later
            after = metrics(port)
            if not after.get("tiny_decoder_num_requests_running") and \
                    not after.get("tiny_decoder_num_requests_waiting"):
                break
            time.sleep(0.5)
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    checks = []

    def check(name, ok, detail):
        checks.append((name, ok))
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")

    cut = [r for r in recs if r["cut"]]
    done = [r for r in recs if not r["cut"] and r["status"] == 200 and r["finish"]]
    lost = [r for r in recs if not r["cut"] and not (r["status"] == 200 and r["finish"])]
    n429 = sum(r["status"] == 429 for r in recs)
    check("no request lost", not lost, f"{len(recs)} sent, {len(cut)} cut on purpose, "
          f"{len(done)} completed, {len(lost)} lost ({n429} of them 429)"
          + (f"; first: {lost[0]}" if lost else ""))
    mixed = [r for r in done if r["text"] != refs[r["q"]]["text"]]
    check("none mixed", len(mixed) <= 0.05 * len(done),
          f"{len(mixed)}/{len(done)} completed replies differ from their warm-up reference"
          + (f"; first, q{mixed[0]['q']}: {mixed[0]['text']!r} vs {refs[mixed[0]['q']]['text']!r}"
             if mixed else ""))
    k = max(1, len(rss) // 5)
    rss0, rss1 = statistics.median(rss[:k]), statistics.median(rss[-k:])
    check("memory flat", rss1 <= 1.10 * rss0, f"VmRSS median {rss0 / 2**20:.0f} MiB (first 20%) "
          f"-> {rss1 / 2**20:.0f} MiB (last 20%), {len(rss)} samples, max {max(rss) / 2**20:.0f} MiB")
    sent = len(recs) - n429  # a 429 never runs, so it never finishes
    fin = finished(after) - finished(before)
    gen = after["tiny_decoder_generation_tokens_total"] - before["tiny_decoder_generation_tokens_total"]
    got = sum(r["usage"]["completion_tokens"] for r in recs if r["usage"])
    reasons = {k.split('"')[1]: int(v - before.get(k, 0)) for k, v in after.items()
               if k.startswith("tiny_decoder_requests_finished_total") and v > before.get(k, 0)}
    check("/metrics consistent", fin == sent and gen >= got,
          f"requests_finished_total +{fin:.0f} {reasons} for {sent} sent; "
          f"generation_tokens_total +{gen:.0f} >= {got} in usage")
    running = peak.get(WATCH[0], 0)
    detail = f"peak sequences running at once {running:.0f}; old fixed slots in the same memory {slots}"
    if kv:
        check("more sequences than fixed slots", running > slots, detail)
    else:
        print(f"(no KV pool line) {detail}")
    for k in WATCH[1:]:
        if k in peak:
            print(f"{k}: min {low[k]:.0f}, max {peak[k]:.0f}")

    ttfts = [r["ttft"] for r in done if r["ttft"]]
    ratios = [(r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
              / r["usage"]["prompt_tokens"] for r in done if r["usage"]]
    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "model": args.model,
        "dtype": args.dtype or "auto", "tokens": args.tokens, "clients": args.clients,
        "duration_s": args.duration, "span_s": span, "context": args.context,
        "kv_memory": args.kv_memory, "max_batch": args.max_batch, "kv_pool_line": kv and kv.group(0),
        "pool_bytes": pool_bytes, "fixed_slots": slots, "peaks": peak, "lows": low,
        "prompt_tokens": refs[0]["usage"]["prompt_tokens"], "sent": len(recs), "cut": len(cut),
        "completed": len(done), "lost": len(lost), "http_429": n429, "mismatched": len(mixed),
        "rss_bytes": rss, "finished_delta": fin, "finished_by_reason": reasons,
        "generation_tokens_delta": gen, "usage_completion_tokens": got,
        "completed_per_min": len(done) / span * 60, "server_tok_s": gen / span,
        "client_tok_s": got / span, "ttft_p50_s": pct(ttfts, 0.5), "ttft_p99_s": pct(ttfts, 0.99),
        "cached_over_prompt": statistics.mean(ratios) if ratios else 0.0,
        "checks": dict(checks), "server_stderr_tail": proc.log[-20:],
        "requests": [{k: v for k, v in r.items() if k != "text"} for r in recs],
    }
    path = write_report("bench_serve_pool", report)
    print(f"\n| {args.clients} clients, {span:.0f} s | completed / min | generated tok/s (in usage) "
          f"| TTFT p50 / p99 | cached / prompt | peak running | fixed slots |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {len(done)} done, {len(cut)} cut, {len(lost)} lost | {report['completed_per_min']:.1f} "
          f"| {report['server_tok_s']:.1f} ({report['client_tok_s']:.1f}) "
          f"| {report['ttft_p50_s']:.2f} s / {report['ttft_p99_s']:.2f} s "
          f"| {report['cached_over_prompt']:.3f} | {running:.0f} | {slots} |")
    if proc.log:
        print("server stderr after start (tail):\n" + "".join(proc.log[-10:]), file=sys.stderr)
    print(f"written {path}", file=sys.stderr)
    return 0 if all(ok for _, ok in checks) else 1


def long_prompts(port, count, tokens, room):
    """`count` prompts of about `tokens` tokens each, every one its own text from its first
    block on: the handbook's sentences from a different start, cut to the length the server's
    tokenizer gives (its usage of a probe text), checked on one more text of the same kind
    (not one of the `count`, whose blocks would then be cached before the cold round) to
    leave `room` tokens of the context."""
    sentences = handbook(40 * (count + 1) + 4 * tokens).split(". ")

    def usage(prompt):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        conn.request("POST", "/v1/completions", json.dumps(
            {"model": MODEL, "prompt": prompt, "max_tokens": 1}),
            {"Content-Type": "application/json"})
        reply = json.loads(conn.getresponse().read())
        if "usage" not in reply:
            sys.exit(f"sizing the prompts: {reply}")
        return reply["usage"]["prompt_tokens"]

    probe = ". ".join(sentences[40:50])
    chars = int(0.97 * tokens * len(probe) / usage(probe))
    texts = [(f"Document {i}: " + ". ".join(sentences[40 * i:]))[:chars].rsplit(". ", 1)[0]
             + ". " + PROMPTS[i % len(PROMPTS)] for i in range(count + 1)]
    spare = usage(texts[count])
    print(f"long prompts: {chars} characters, a spare one {spare} tokens", file=sys.stderr)
    if spare > room:
        sys.exit(f"a long prompt of {spare} tokens leaves no room for the completion: "
                 f"raise --context")
    return texts[:count]


def write_report(name, report):
    """report as target/NAME-DATE.json; returns the path."""
    os.makedirs(os.path.join(ROOT, "target"), exist_ok=True)
    path = os.path.join(ROOT, "target", f"{name}-{datetime.date.today():%Y%m%d}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    return path


def cpu_name():
    """The CPU's model name from /proc/cpuinfo, or '' (aarch64 kernels give none)."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return ""
    m = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    return m.group(1).strip() if m else ""


def long_context(args):
    """`--long`: see the header. Returns the exit status."""
    global MODEL
    servers = {}
    try:
        for model in [args.model, *args.compare]:
            one = argparse.Namespace(**{**vars(args), "model": model})
            proc, port, banner = start_server(one, extra=("--context", str(args.context)))
            kv = re.search(r"KV cache: .*", banner)
            servers[model] = (proc, port, kv.group(0) if kv else "")
            print(f"{model}: {servers[model][2]}", file=sys.stderr)
        rounds = {m: {"cold": None, "warm": []} for m in servers}
        prompts = {}
        for model, (proc, port, _) in servers.items():
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("GET", "/v1/models")
            MODEL = json.loads(conn.getresponse().read())["data"][0]["id"]
            room = args.context - args.tokens
            prompts[model] = (MODEL, long_prompts(port, args.streams, args.long, room))
            start = time.time()
            got = run_round(port, args.streams, args.tokens, prompts=prompts[model][1])
            got["wall_s"] = time.time() - start
            rounds[model]["cold"] = got
            print(f"{model} cold: " + json.dumps(got), file=sys.stderr)
        for r in range(args.rounds):
            order = list(servers) if r % 2 == 0 else list(servers)[::-1]
            for model in order:
                MODEL, texts = prompts[model]
                got = run_round(servers[model][1], args.streams, args.tokens, prompts=texts)
                rounds[model]["warm"].append(got)
                print(f"round {r + 1} {model}: " + json.dumps(got), file=sys.stderr)
    finally:
        for proc, _, _ in servers.values():
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    med = lambda model, key: statistics.median(g[key] for g in rounds[model]["warm"])
    base = med(args.model, "aggregate_tok_s")
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "cpu": cpu_name(), "dtype": args.dtype or "auto", "prompt_tokens": args.long, "tokens": args.tokens,
              "streams": args.streams, "max_batch": args.max_batch, "context": args.context,
              "models": {m: {"kv_line": servers[m][2], "rounds": rounds[m],
                             "warm_aggregate_tok_s": med(m, "aggregate_tok_s"),
                             "cold_wall_s": rounds[m]["cold"]["wall_s"]}
                         for m in servers}}
    path = write_report("bench_serve_long", report)
    print(f"| model | KV per token | {args.streams} streams of ~{args.long} tokens: decode "
          f"aggregate, warm (vs first) | cold: all answered in |")
    print("|---|---|---|---|")
    for m in servers:
        warm, cold = med(m, "aggregate_tok_s"), rounds[m]["cold"]["wall_s"]
        per = re.search(r"(\d+) bytes per token", servers[m][2])
        print(f"| {os.path.basename(m.rstrip('/'))} | {per.group(1) if per else '?'} B "
              f"| {warm:.1f} tok/s ({warm / base:.2f}x) | {cold:.0f} s |")
    print(f"written {path}", file=sys.stderr)
    short = [g["short"] + g["requests"] - g["answered"] for m in rounds for g in rounds[m]["warm"]]
    return 1 if any(short) else 0


def main():
    ap = argparse.ArgumentParser()
    default_model = os.path.join(ROOT, "target/models/smollm2-135m-instruct")
    ap.add_argument("--model", default=default_model)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--tokens", type=int, default=None, help="128; with --pool, 32; with --long, 64")
    ap.add_argument("--streams", type=int, default=None, help="8; with --long, 16")
    ap.add_argument("--burst", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-batch", type=int, default=None, help="8; with --pool, 64")
    ap.add_argument("--constrained", action="store_true",
                    help="also run the batch under a JSON-schema response_format (masking cost)")
    ap.add_argument("--pool", action="store_true", help="the KV pool soak instead of the rounds")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=120)
    ap.add_argument("--context", type=int, default=None,
                    help="with --pool, 3300; with --long, P + --tokens + 64")
    ap.add_argument("--kv-memory", default=None, help="passed to serve (bytes; 2G, 512M)")
    ap.add_argument("--long", type=int, default=0, metavar="P",
                    help="long-context rounds with prompts of ~P tokens instead (see the header)")
    ap.add_argument("--compare", action="append", default=[], metavar="MODEL",
                    help="with --long: another model measured in the same rounds")
    args = ap.parse_args()
    if args.model == default_model and not os.path.isdir(args.model):  # another HF directory there
        models = os.path.join(ROOT, "target", "models")
        found = sorted(d for d in (os.listdir(models) if os.path.isdir(models) else [])
                       if os.path.exists(os.path.join(models, d, "config.json")))
        args.model = os.path.join(models, found[0]) if found else args.model
    args.tokens = args.tokens or (32 if args.pool else 64 if args.long else 128)
    args.max_batch = args.max_batch or (64 if args.pool else 16 if args.long else 8)
    args.streams = args.streams or (16 if args.long else 8)
    args.context = args.context or (args.long + args.tokens + 64 if args.long else 3300)
    if args.pool:
        sys.exit(pool(args))
    if args.long:
        sys.exit(long_context(args))
    global MODEL
    proc, port, banner = start_server(args)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("GET", "/v1/models")
        MODEL = json.loads(conn.getresponse().read())["data"][0]["id"]
        # Warm-up, not measured: a whole batch and a single, so that the first measured round
        # does not share the CPU with the server's first pages (its move of the weights and
        # the KV pool into huge pages runs for a second or more after the start: measured
        # from a warm-up of 8 tokens, the first round's single and batch read half the others').
        run_round(port, args.streams, args.tokens)
        run_round(port, 1, args.tokens)
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
        "cpu": cpu_name(),
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
    path = write_report("bench_serve", report)
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
