#!/usr/bin/env python3
"""tiny-decoder against llama.cpp on GGUF files as given: decode and prefill, alternating rounds.

For each file, rounds alternate the two engines (order swapped every round) because the machine
is shared; each engine runs with 2 threads (--threads N), one fresh process per run:
  ours:      $TINY_DECODER_BIN bench -m FILE --prompt-tokens 64 --new-tokens 32 --json  (decode,
             prefill 64) and --prompt-tokens 512 --new-tokens 0 (prefill 512); RAYON_NUM_THREADS=2
  llama.cpp: llama-bench -m FILE -t 2 -p 64,512 -n 32 -r 1 -o json
The table has medians, ours / llama.cpp, and our peak RSS against the file's size.

usage (after scripts/llamacpp_build.sh and scripts/make_kquants.sh):
  scripts/bench_gguf.py [--rounds 3] [FILE.gguf ...]
    (default: target/models/kquants/smollm2-135m-instruct-{Q8_0,Q4_1,Q5_0,Q4_K_M,Q5_K_M,Q6_K}.gguf)
"""
import argparse
import json
import os
import statistics
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("TINY_DECODER_BIN", os.path.join(ROOT, "target/release/tiny-decoder"))
LLAMA = os.path.join(ROOT, "target/llama.cpp/build/bin/llama-bench")
DEFAULT = [f"target/models/kquants/smollm2-135m-instruct-{t}.gguf"
           for t in ["Q8_0", "Q4_1", "Q5_0", "Q4_K_M", "Q5_K_M", "Q6_K"]]


THREADS = "2"


def ours(path, prompt, new):
    env = dict(os.environ, RAYON_NUM_THREADS=THREADS)
    out = subprocess.run([BIN, "bench", "-m", path, "--prompt-tokens", str(prompt),
                          "--new-tokens", str(new), "--json"],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama(path):
    out = subprocess.run([LLAMA, "-m", path, "-t", THREADS, "-p", "64,512", "-n", "32", "-r", "1",
                          "-o", "json"], capture_output=True, text=True, check=True)
    return {(f"pp{e['n_prompt']}" if e["n_prompt"] else "tg"): e["avg_ts"]
            for e in json.loads(out.stdout)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="each engine's threads")
    ap.add_argument("files", nargs="*", default=DEFAULT)
    args = ap.parse_args()
    global THREADS
    THREADS = str(args.threads)
    print("| file | decode, ours / llama.cpp | prefill 64 | prefill 512 | our peak RSS / file |")
    print("|---|---|---|---|---|")
    for path in args.files:
        got = {}
        for k in range(args.rounds):
            for engine in (("ours", "llama") if k % 2 == 0 else ("llama", "ours")):
                if engine == "ours":
                    a, b = ours(path, 64, 32), ours(path, 512, 0)
                    row = {"tg": a["decode_tokens_per_s"], "pp64": a["prefill_tokens_per_s"],
                           "pp512": b["prefill_tokens_per_s"], "rss": a["peak_rss_bytes"]}
                else:
                    row = llama(path)
                for key, v in row.items():
                    got.setdefault((engine, key), []).append(v)
        med = {k: statistics.median(v) for k, v in got.items()}
        cells = [f"{med['ours', c]:.0f} / {med['llama', c]:.0f} = {med['ours', c] / med['llama', c]:.2f}x"
                 for c in ("tg", "pp64", "pp512")]
        size = os.path.getsize(path)
        rss = f"{med['ours', 'rss'] / 1e6:.0f} MB / {size / 1e6:.0f} MB"
        print(f"| {os.path.basename(path)} | " + " | ".join(cells) + f" | {rss} |", flush=True)


if __name__ == "__main__":
    main()
