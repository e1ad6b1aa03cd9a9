#!/usr/bin/env python3
"""`tiny-decoder serve` under load for a while: `--clients` (64) concurrent chat clients, all
with one long system prompt (~`--system-tokens` 3000), each asking one of 8 questions in a
loop for `--seconds` (120), a fifth of them hanging up after the first chunk. Checks, and
prints:

- no request lost: every request answered 200 (or 429 when the queue is full), none failed;
- none mixed: every complete greedy reply to the same question is the same text;
- /metrics agrees with the clients: requests received + rejected = sent, every received
  request finished, tokens in and out at least what the clients were told;
- memory flat: the server's RSS sampled every 2 s after the first minute of load;
- the system prompt prefilled about once per cache, then reused or copied (cached tokens).

usage:
  scripts/serve_soak.py [--model target/models/smollm2-135m-instruct] [--clients 64]
      [--seconds 120] [--max-batch 8] [--system-tokens 3000]
Writes target/serve_soak-DATE.json. Python stdlib only. Exit status 1 when a check fails.
"""
import argparse
import datetime
import http.client
import json
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = os.environ.get("TINY_DECODER_BIN", os.path.join(ROOT, "target", "release", "tiny-decoder"))
QUESTIONS = ["What is the story about?", "Who is the main character?", "Where does it happen?",
             "Summarize it in one line.", "What happens first?", "What is the mood?",
             "Name one object in it.", "How does it end?"]


def start(args):
    cmd = [OURS, "serve", "-m", args.model, "--port", "0", "--max-batch", str(args.max_batch),
           "--max-queue", str(args.clients * 2), "--context", str(args.system_tokens + 300),
           "--request-timeout", "600"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        m = re.search(r"listening on http://[^:]+:(\d+)", line)
        if m:
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, int(m.group(1))
    sys.exit("serve did not start")


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


def ask(port, system, question, hang_up):
    """One streamed chat request: {status, text, usage, hung_up}."""
    body = json.dumps({"messages": [{"role": "system", "content": system},
                                    {"role": "user", "content": question}],
                       "max_tokens": 24, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        resp.read()
        return {"status": resp.status}
    text, usage, error = [], None, None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        msg = json.loads(line[6:])
        error = msg.get("error") or error
        usage = msg.get("usage") or usage
        for c in msg.get("choices", []):
            if c["delta"].get("content"):
                text.append(c["delta"]["content"])
                if hang_up:
                    conn.close()
                    return {"status": 200, "hung_up": True}
    return {"status": 200, "text": "".join(text), "usage": usage, "error": error,
            "hung_up": False}


def metrics(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/metrics")
    out = {}
    for line in conn.getresponse().read().decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "target/models/smollm2-135m-instruct"))
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=3000)
    args = ap.parse_args()
    passage = open(os.path.join(ROOT, "tests/data/stories-heldout.txt")).read()
    system = "You answer questions about this text.\n\n" + (passage * 20)[:args.system_tokens * 4]
    proc, port = start(args)
    results, lock, rss = [], threading.Lock(), []
    start_time = time.time()
    deadline = start_time + args.seconds

    def client(i):
        rng = random.Random(i)
        while time.time() < deadline:
            q = rng.randrange(len(QUESTIONS))
            r = ask(port, system, QUESTIONS[q], rng.random() < 0.2)
            r["question"] = q
            with lock:
                results.append(r)

    def sample():
        while time.time() < deadline:
            rss.append((time.time() - start_time, rss_mb(proc.pid)))
            time.sleep(2)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    threads.append(threading.Thread(target=sample))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(2)  # the last requests' counters
    m = metrics(port)
    proc.terminate()
    proc.wait(timeout=60)

    done = [r for r in results if r["status"] == 200 and not r.get("hung_up")]
    failed = [r for r in done if r.get("error") or r.get("usage") is None]
    rejected = sum(1 for r in results if r["status"] == 429)
    other = [r["status"] for r in results if r["status"] not in (200, 429)]
    by_question = {}
    for r in done:
        by_question.setdefault(r["question"], set()).add(r.get("text"))
    mixed = {q: len(t) for q, t in by_question.items() if len(t) > 1}
    finished = sum(v for k, v in m.items() if k.startswith("tiny_decoder_requests_finished_total"))
    received = m["tiny_decoder_requests_received_total"]
    prompt = sum(r["usage"]["prompt_tokens"] for r in done if r.get("usage"))
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in done if r.get("usage"))
    late = [mb for t, mb in rss if t > 60] or [mb for _, mb in rss]
    checks = {
        "no request failed": not failed and not other,
        "none mixed (one text per question)": not mixed,
        "received + rejected = sent": received + m["tiny_decoder_requests_rejected_total"] == len(results),
        "every received request finished": finished == received,
        "prompt tokens counted >= clients'": m["tiny_decoder_prompt_tokens_total"] >= prompt,
        "memory flat after 60 s (max/min < 1.05)": max(late) / min(late) < 1.05,
    }
    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "args": vars(args),
        "requests": len(results), "complete": len(done),
        "hung_up": sum(1 for r in results if r.get("hung_up")), "rejected_429": rejected,
        "failed": len(failed), "other_status": other, "mixed": mixed,
        "prompt_tokens_complete": prompt, "cached_tokens_complete": cached,
        "ttft_s_sum": m.get("tiny_decoder_time_to_first_token_seconds_sum"),
        "ttft_count": m.get("tiny_decoder_time_to_first_token_seconds_count"),
        "rss_mb_min_max_after_60s": [min(late), max(late)], "metrics": m, "checks": checks,
    }
    path = os.path.join(ROOT, "target", f"serve_soak-{datetime.date.today()}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"{len(results)} requests in {args.seconds:.0f} s from {args.clients} clients: "
          f"{len(done)} complete, {report['hung_up']} hung up, {rejected} answered 429")
    print(f"prompt tokens of complete requests: {prompt}, of which cached {cached} "
          f"({cached / max(prompt, 1):.1%})")
    if report["ttft_count"]:
        print(f"mean time to first token: {report['ttft_s_sum'] / report['ttft_count']:.2f} s")
    print(f"server RSS after 60 s: {min(late):.0f}-{max(late):.0f} MB")
    for name, ok in checks.items():
        print(f"{'ok' if ok else 'FAILED'}: {name}")
    print(f"written {path}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
