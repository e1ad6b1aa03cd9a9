"""The README's variant table: the four bundled models side by side.

For each of tiny-mha, tiny-gqa, tiny-mqa, tiny-mla: parameters and KV bytes per token
(`info`), held-out perplexity (`eval` on tests/data/shakespeare-heldout.txt), and decode
tok/s with the context full (`bench`, 192-token prompt + 63 new tokens = 255 positions),
in interleaved rounds so that machine noise hits every variant alike; medians are printed.
Standard library only:

    python3 scripts/compare_variants.py [--bin target/release/tiny-decoder] [--rounds 5]
"""

import argparse
import json
import statistics
import subprocess

VARIANTS = ["tiny-mha", "tiny-gqa", "tiny-mqa", "tiny-mla"]


def run(binary, *args):
    out = subprocess.run([binary, *args, "--json"], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/tiny-decoder")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--heldout", default="tests/data/shakespeare-heldout.txt")
    a = ap.parse_args()
    info = {v: run(a.bin, "info", "--model", v) for v in VARIANTS}
    ppl = {v: run(a.bin, "eval", "--model", v, "--file", a.heldout)["perplexity"] for v in VARIANTS}
    speed = {v: [] for v in VARIANTS}
    for _ in range(a.rounds):
        for v in VARIANTS:
            r = run(a.bin, "bench", "--model", v, "--prompt-tokens", "192", "--new-tokens", "63")
            speed[v].append(r["decode_tokens_per_s"])
    base = statistics.median(speed["tiny-mha"])
    print("| variant | parameters | KV bytes per token | held-out perplexity | decode tok/s at 255 positions (vs MHA) |")
    print("|---|---|---|---|---|")
    for v in VARIANTS:
        med = statistics.median(speed[v])
        print(f"| {v} | {info[v]['num_parameters']:,} | {info[v]['kv_bytes_per_token']:,} | "
              f"{ppl[v]:.2f} | {med:.0f} ({med / base:.2f}×) |")


if __name__ == "__main__":
    main()
