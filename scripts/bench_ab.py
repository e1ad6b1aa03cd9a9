#!/usr/bin/env python3
"""Alternating A/B(/C..) runs of `tiny-decoder bench --json`, with medians and ratios.

The machine is shared, so absolute numbers drift; the binaries run back to back in each round
(order rotated per round) and the report quotes per-binary medians and ratios to the first.

usage: scripts/bench_ab.py --config configs/bench-smollm135m.json --dtype f32 \
           --prompt-tokens 32 --new-tokens 128 --rounds 3 NAME=BINARY [NAME=BINARY ...]
"""
import argparse
import json
import statistics
import subprocess
import sys

KEYS = ["decode_tokens_per_s", "prefill_tokens_per_s", "decode_read_gb_per_s"]


def run(binary, a):
    cmd = [binary, "bench", "--config", a.config, "--dtype", a.dtype,
           "--prompt-tokens", str(a.prompt_tokens), "--new-tokens", str(a.new_tokens), "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--dtype", default="f32")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("bins", nargs="+", help="NAME=PATH")
    a = p.parse_args()
    bins = [b.split("=", 1) for b in a.bins]
    res = {name: [] for name, _ in bins}
    for r in range(a.rounds):
        order = bins[r % len(bins):] + bins[:r % len(bins)]
        for name, path in order:
            out = run(path, a)
            res[name].append(out)
            vals = " ".join(f"{k}={out[k]:.2f}" for k in KEYS)
            print(f"round {r} {name}: {vals}", file=sys.stderr, flush=True)
    base = bins[0][0]
    med = {n: {k: statistics.median(o[k] for o in res[n]) for k in KEYS} for n in res}
    print(f"## {a.config} dtype={a.dtype} prompt={a.prompt_tokens} new={a.new_tokens} "
          f"rounds={a.rounds}")
    print("| binary | decode tok/s | prefill tok/s | decode GB/s | decode ratio | prefill ratio |")
    print("|---|---|---|---|---|---|")
    for n in res:
        m = med[n]
        print(f"| {n} | {m[KEYS[0]]:.1f} | {m[KEYS[1]]:.1f} | {m[KEYS[2]]:.2f} | "
              f"{m[KEYS[0]] / med[base][KEYS[0]]:.2f} | {m[KEYS[1]] / med[base][KEYS[1]]:.2f} |")


if __name__ == "__main__":
    main()
