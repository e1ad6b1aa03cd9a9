#!/usr/bin/env python3
"""tiny-decoder against llama.cpp on GGUF files as given: decode and prefill, alternating rounds.

For each file, rounds alternate the two engines (order swapped every round) because the machine
is shared; each engine runs with 2 threads (--threads N), one fresh process per run:
  ours:      $TINY_DECODER_BIN bench -m FILE --prompt-tokens 64 --new-tokens 32 --json  (decode,
             prefill 64) and --prompt-tokens 512 --new-tokens 0 (prefill 512); RAYON_NUM_THREADS=2
  llama.cpp: llama-bench -m FILE -t 2 -p 64,512 -n 32 -r 1 -o json
With --depth D, a last column: decode of 32 tokens after a D-token prompt (ours --prompt-tokens
D --new-tokens 32; llama-bench -p 0 -n 32 -d D), each engine with its default cache (ours bf16
for block weights, llama.cpp's f16). With --batch N, another: the aggregate decode of N
sequences of 32 + 128 tokens at once (ours bench --batch N --prompt-tokens 32 --new-tokens 128;
llama-batched-bench -npp 32 -ntg 128 -npl N, its S_TG).
The table has medians, ours / llama.cpp, and our peak RSS against the file's size.

usage (after scripts/llamacpp_build.sh and scripts/make_kquants.sh):
  scripts/bench_gguf.py [--rounds 3] [--depth D] [--batch N] [FILE.gguf ...]
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
BATCHED = os.path.join(ROOT, "target/llama.cpp/build/bin/llama-batched-bench")
DEFAULT = [f"target/models/kquants/smollm2-135m-instruct-{t}.gguf"
           for t in ["Q8_0", "Q4_1", "Q5_0", "Q4_K_M", "Q5_K_M", "Q6_K"]]


THREADS = "2"


def ours(path, prompt, new, batch=1):
    env = dict(os.environ, RAYON_NUM_THREADS=THREADS)
    out = subprocess.run([BIN, "bench", "-m", path, "--prompt-tokens", str(prompt),
                          "--new-tokens", str(new), "--batch", str(batch), "--json"],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama(path, more=("-p", "64,512", "-n", "32")):
    out = subprocess.run([LLAMA, "-m", path, "-t", THREADS, *more, "-r", "1", "-o", "json"],
                         capture_output=True, text=True, check=True)
    return {(f"pp{e['n_prompt']}" if e["n_prompt"] else "tg"): e["avg_ts"]
            for e in json.loads(out.stdout)}


def llama_batched(path, n):
    out = subprocess.run([BATCHED, "-m", path, "-t", THREADS, "-tb", THREADS, "-c", str(160 * n),
                          "-npp", "32", "-ntg", "128", "-npl", str(n), "--output-format", "jsonl"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["speed_tg"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="each engine's threads")
    ap.add_argument("--depth", type=int, default=0, help="also decode after this many positions")
    ap.add_argument("--batch", type=int, default=0, help="also decode this many sequences at once")
    ap.add_argument("files", nargs="*", default=DEFAULT)
    args = ap.parse_args()
    global THREADS
    THREADS = str(args.threads)
    cols = ("tg", "pp64", "pp512") + (("deep",) if args.depth else ()) + (
        ("batch",) if args.batch else ())
    more = (f" | decode after {args.depth}" if args.depth else "") + (
        f" | {args.batch} sequences' decode" if args.batch else "")
    print(f"| file | decode, ours / llama.cpp | prefill 64 | prefill 512{more} | our peak RSS / file |")
    print("|---|---|---|---|---|" + "---|" * (len(cols) - 3))
    for path in args.files:
        got = {}
        for k in range(args.rounds):
            for engine in (("ours", "llama") if k % 2 == 0 else ("llama", "ours")):
                if engine == "ours":
                    a, b = ours(path, 64, 32), ours(path, 512, 0)
                    row = {"tg": a["decode_tokens_per_s"], "pp64": a["prefill_tokens_per_s"],
                           "pp512": b["prefill_tokens_per_s"], "rss": a["peak_rss_bytes"]}
                    if args.depth:
                        row["deep"] = ours(path, args.depth, 32)["decode_tokens_per_s"]
                    if args.batch:
                        row["batch"] = ours(path, 32, 128, args.batch)["decode_tokens_per_s"]
                else:
                    row = llama(path)
                    if args.depth:
                        d = ("-p", "0", "-n", "32", "-d", str(args.depth))
                        row["deep"] = llama(path, d)["tg"]
                    if args.batch:
                        row["batch"] = llama_batched(path, args.batch)
                for key, v in row.items():
                    got.setdefault((engine, key), []).append(v)
        med = {k: statistics.median(v) for k, v in got.items()}
        cells = [f"{med['ours', c]:.0f} / {med['llama', c]:.0f} = {med['ours', c] / med['llama', c]:.2f}x"
                 for c in cols]
        size = os.path.getsize(path)
        rss = f"{med['ours', 'rss'] / 1e6:.0f} MB / {size / 1e6:.0f} MB"
        print(f"| {os.path.basename(path)} | " + " | ".join(cells) + f" | {rss} |", flush=True)


if __name__ == "__main__":
    main()
