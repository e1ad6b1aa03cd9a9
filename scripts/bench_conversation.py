#!/usr/bin/env python3
"""A chat conversation replayed through `tiny-decoder serve`'s /v1/chat/completions, turn
by turn, as a chat client sends it: the whole conversation every turn. With prefix reuse the
server prefills only each turn's new messages; `cache_prompt: false` (llama-server's field)
makes it prefill everything, for comparison. Per turn: prompt tokens, tokens prefilled
(prompt - `usage.prompt_tokens_details.cached_tokens`), and time to first token (TTFT,
streamed, to the first chunk with text), both ways, medians over `--rounds`.

usage:
  scripts/bench_conversation.py [--model target/models/smollm2-135m-instruct] [--turns 20]
      [--tokens 48] [--rounds 3]
Prints a markdown table and writes target/bench_conversation-DATE.json. Python stdlib only.
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
TOPICS = ["lighthouses", "steam engines", "markets", "mountains", "bicycles", "bread",
          "the sea", "sunsets", "bees", "rivers", "clocks", "libraries", "bridges", "owls",
          "glass", "maps", "trains", "gardens", "volcanoes", "violins"]


def start_server(model):
    cmd = [OURS, "serve", "-m", model, "--port", "0", "--max-batch", "2"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        m = re.search(r"listening on http://[^:]+:(\d+)", line)
        if m:
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, int(m.group(1))
    proc.kill()
    sys.exit("serve did not report its address:\n" + "".join(lines))


def turn(port, messages, tokens, cache):
    """One streamed chat request: (reply text, usage, TTFT seconds)."""
    body = json.dumps({"messages": messages, "max_tokens": tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True},
                       "cache_prompt": cache})
    start = time.time()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        sys.exit(f"turn failed: {resp.status} {resp.read()[:300]}")
    text, usage, first = [], None, None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        msg = json.loads(line[6:])
        usage = msg.get("usage") or usage
        for c in msg.get("choices", []):
            piece = c.get("delta", {}).get("content")
            if piece:
                first = first or time.time()
                text.append(piece)
    return "".join(text), usage, (first or time.time()) - start


def replay(port, args, cache, session, fixed=None):
    """The conversation; `fixed`: the replies of an earlier replay, sent as they were.
    `session` makes the system prompt differ from every other replay's, so that turn 1
    finds nothing cached, as a new conversation's first turn."""
    system = f"You are a knowledgeable, friendly guide (session {session})."
    messages = [{"role": "system", "content": system}]
    rows = []
    for i in range(args.turns):
        messages.append({"role": "user",
                         "content": f"Tell me something surprising about {TOPICS[i % 20]}."})
        text, usage, ttft = turn(port, messages, args.tokens, cache)
        reply = fixed[i]["reply"] if fixed else text
        messages.append({"role": "assistant", "content": reply})
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        rows.append({"reply": reply, "prompt": usage["prompt_tokens"],
                     "prefilled": usage["prompt_tokens"] - cached, "ttft": ttft})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "target/models/smollm2-135m-instruct"))
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    proc, port = start_server(args.model)
    try:
        first = replay(port, args, True, 0)
        runs = {True: [first], False: []}
        for r in range(args.rounds):
            for cache in (False, True):  # alternating
                if r == 0 and cache:
                    continue
                runs[cache].append(replay(port, args, cache, 1 + len(runs[True]) + len(runs[False]), first))
    finally:
        proc.kill()
    med = lambda cache, i, key: statistics.median(run[i][key] for run in runs[cache])
    print(f"conversation of {args.turns} turns, {args.tokens} tokens a reply, "
          f"{args.model}, {platform.processor() or platform.machine()}, medians of "
          f"{args.rounds}\n")
    print("| turn | prompt tokens | prefilled (reuse) | TTFT reuse ms | prefilled (none) | "
          "TTFT none ms |")
    print("|---|---|---|---|---|---|")
    table = []
    for i in range(args.turns):
        row = {"turn": i + 1, "prompt": first[i]["prompt"],
               "prefilled_reuse": med(True, i, "prefilled"), "ttft_reuse": med(True, i, "ttft"),
               "prefilled_none": med(False, i, "prefilled"), "ttft_none": med(False, i, "ttft")}
        table.append(row)
        print(f"| {row['turn']} | {row['prompt']} | {row['prefilled_reuse']:.0f} | "
              f"{row['ttft_reuse'] * 1e3:.0f} | {row['prefilled_none']:.0f} | "
              f"{row['ttft_none'] * 1e3:.0f} |")
    last, one = table[-1], table[0]
    print(f"\nTTFT at turn {args.turns} / turn 1: with reuse "
          f"{last['ttft_reuse'] / one['ttft_reuse']:.2f}x, without "
          f"{last['ttft_none'] / one['ttft_none']:.2f}x")
    out = os.path.join(ROOT, "target", f"bench_conversation-{datetime.date.today()}.json")
    with open(out, "w") as f:
        json.dump({"args": vars(args), "turns": table}, f, indent=1)


if __name__ == "__main__":
    main()
