#!/usr/bin/env python3
"""Side by side on SmolLM-135M's shape: tiny-decoder vs candle-transformers vs HF transformers.

All three run the same random-init checkpoint (scripts/make_bench_checkpoint.py ->
target/bench-smollm135m/) on the same synthetic prompt ids ((i * 7919 + 13) % vocab), greedy,
and are timed the same way as `tiny-decoder bench` (src/bench.rs), one fresh process per run,
no warm-up run:
  prefill = one forward of the whole prompt (cache filled), prompt_tokens / seconds;
  decode  = new_tokens steps of (argmax of the last logits -> forward of that one token with the
            KV cache), new_tokens / seconds.
  - ours:   target/release/tiny-decoder bench --model DIR --dtype D --prompt-tokens P --new-tokens N --json
  - candle: scripts/compare/target/release/candle-compare (candle-transformers 0.11.1
            models::llama with its own llama::Cache; same flags)
  - hf:     this file run with the venv python in `--hf-worker` mode: LlamaForCausalLM,
            attn_implementation="eager", torch.set_num_threads(2), torch.inference_mode(),
            a manual loop with past_key_values (DynamicCache) rather than model.generate, so that
            prefill and decode are timed exactly like the other two.
Runs alternate within each round (order rotated per round) because the machine is shared;
the table gives per-engine medians and the ratios ours/candle and ours/HF.

usage: scripts/bench_compare.py [--rounds 3] [--skip-long] [--long-dtypes f32,bf16]
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "target", "bench-smollm135m")
OURS = os.path.join(ROOT, "target", "release", "tiny-decoder")
CANDLE = os.path.join(ROOT, "scripts", "compare", "target", "release", "candle-compare")
VENV_PY = os.path.join(ROOT, ".venv", "bin", "python")
KEYS = ["decode_tokens_per_s", "prefill_tokens_per_s"]


def hf_worker(model_dir, dtype, prompt_tokens, new_tokens):
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(2)
    td = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=td, attn_implementation="eager")
    model.eval()
    vocab = model.config.vocab_size
    ids = torch.tensor([[(i * 7919 + 13) % vocab for i in range(prompt_tokens)]])
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        prefill = time.perf_counter() - t0
        past, logits = out.past_key_values, out.logits[0, -1]
        first = []
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            nxt = int(torch.argmax(logits))
            if len(first) < 8:
                first.append(nxt)
            out = model(input_ids=torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1].float()
        decode = time.perf_counter() - t0
    print(json.dumps({
        "engine": "transformers eager", "dtype": dtype, "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens, "prefill_tokens_per_s": prompt_tokens / prefill,
        "decode_tokens_per_s": new_tokens / decode, "first_ids": first,
    }))


def cmd_for(engine, dtype, p, n):
    flags = ["--dtype", dtype, "--prompt-tokens", str(p), "--new-tokens", str(n), "--json"]
    if engine == "ours":
        return [OURS, "bench", "--model", MODEL] + flags
    if engine == "candle":
        return [CANDLE, "--model", MODEL] + flags
    return [VENV_PY, os.path.abspath(__file__), "--hf-worker", MODEL, dtype, str(p), str(n)]


def run(engine, dtype, p, n):
    t0 = time.time()
    r = subprocess.run(cmd_for(engine, dtype, p, n), capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{engine} {dtype} failed:\n{r.stderr}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["wall_s"] = time.time() - t0
    return out


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf-worker", nargs=4, metavar=("DIR", "DTYPE", "P", "N"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--engines", default="ours,candle,hf")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--long-prompt", type=int, default=1984)
    ap.add_argument("--long-new", type=int, default=32)
    ap.add_argument("--long-dtypes", default="f32")
    ap.add_argument("--skip-long", action="store_true")
    a = ap.parse_args()
    if a.hf_worker:
        d, dt, p, n = a.hf_worker
        return hf_worker(d, dt, int(p), int(n))

    for path in (OURS, CANDLE, os.path.join(MODEL, "model.safetensors")):
        if not os.path.exists(path):
            sys.exit(f"missing {path} (see the usage notes at the top of this file)")
    engines = a.engines.split(",")
    # (label, dtype, prompt, new, engines)
    scen = [(f"{dt} {a.prompt_tokens}+{a.new_tokens}", dt, a.prompt_tokens, a.new_tokens, engines)
            for dt in a.dtypes.split(",")]
    if not a.skip_long:
        scen += [(f"{dt} {a.long_prompt}+{a.long_new}", dt, a.long_prompt, a.long_new,
                  [e for e in engines if e != "hf"]) for dt in a.long_dtypes.split(",")]
    jobs = [(s, e) for s in scen for e in s[4]]
    res = {}
    started = time.time()
    for r in range(a.rounds):
        k = r % len(jobs)
        for s, e in jobs[k:] + jobs[:k]:
            out = run(e, s[1], s[2], s[3])
            res.setdefault((s[0], e), []).append(out)
            print(f"round {r} {s[0]:>12} {e:>6}: decode {out['decode_tokens_per_s']:7.2f} "
                  f"prefill {out['prefill_tokens_per_s']:8.2f} tok/s  "
                  f"first_ids {out.get('first_ids', '-')}  ({out['wall_s']:.1f} s)",
                  file=sys.stderr, flush=True)

    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"## tiny-decoder vs candle-transformers 0.11.1 vs transformers (eager), "
          f"SmolLM-135M shape, random weights")
    print(f"{date}; nproc {os.cpu_count()}; CPU: {cpu_model()}; rounds {a.rounds} "
          f"(alternating); total {time.time() - started:.0f} s; medians in tokens/s")
    print()
    print("| scenario | metric | ours | candle-transformers | HF transformers | ours/candle | ours/HF |")
    print("|---|---|---|---|---|---|---|")
    for s in scen:
        for key, name in (("decode_tokens_per_s", "decode"), ("prefill_tokens_per_s", "prefill")):
            med = {e: statistics.median(o[key] for o in res[(s[0], e)]) for e in s[4]}
            cell = lambda e: f"{med[e]:.1f}" if e in med else "–"
            ratio = lambda e: f"{med['ours'] / med[e]:.2f}" if e in med and "ours" in med else "–"
            print(f"| {s[0]} | {name} | {cell('ours')} | {cell('candle')} | {cell('hf')} | "
                  f"{ratio('candle')} | {ratio('hf')} |")


if __name__ == "__main__":
    main()
