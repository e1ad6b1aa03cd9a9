#!/usr/bin/env python3
"""tiny-decoder against llama.cpp on the same checkpoint: speed (alternating rounds) and perplexity.

Both engines run with 2 threads (llama-bench -t 2; ours RAYON_NUM_THREADS=2, which sizes our
pool) on synthetic prompts, one fresh process per run, in rounds that alternate the two engines
(order swapped every round) because the machine is shared. Per case and dtype the report has
each engine's median tok/s, its min-max over the rounds, and the ratio ours / llama.cpp.

  ours:      $TINY_DECODER_BIN bench -m DIR --dtype D --prompt-tokens P --new-tokens N --json
             (q8_0/q4_0: quantized at load from the f32 directory; bf16: --bf16-model if given)
  llama.cpp: llama-bench -m NAME-D.gguf -t 2 -r 1 -o json (its own warm-up run first)
     case "P+N" (default 32+128): -p P -n N   (llama.cpp's tgN starts from an empty cache,
                                               ours decodes after the P-token prompt)
     --prefill 512,2000:          -p P -n 0   (ours: --new-tokens 0)
     --long 2000 (decode after a 2000-token prompt): -p 0 -n 32 -d 2000 (ours: 2000+32)

The GGUFs are made once from the same HF directory and cached in target/llamacpp-models/:
convert_hf_to_gguf.py (from the pinned llama.cpp sources) --outtype f32 and bf16, then
llama-quantize f32 -> q8_0 and q4_0. The conversion reads a temporary copy of the directory
whose config.json also has a top-level rope_theta (older converters ignore transformers 5's
rope_parameters and silently write theta 10000); llama.rope.freq_base is checked after.

--perplexity: llama-perplexity -c 512 (its chunks: non-overlapping 512-token windows, the second
half of each scored) against our `eval --context 512 --stride 256` (each scored token also sees
at least 256 tokens), f32/q8_0/q4_0 on the same text; the windows differ, so compare each
engine's ratio to its own f32, not the absolute values.

usage (after scripts/llamacpp_build.sh):
  LLAMACPP_PYTHON=target/venv-llamacpp/bin/python scripts/bench_llamacpp.py \
      [--model target/models/smollm2-135m-instruct] [--bf16-model DIR] [--name smollm2-135m]
      [--dtypes f32,bf16,q8_0,q4_0] [--rounds 5] [--prompt-tokens 32] [--new-tokens 128]
      [--prefill 512,2000] [--long 2000] [--perplexity] [--ppl-file FILE] [--ppl-chars N]
      [--skip-speed] [--omp-passive]
LLAMACPP_PYTHON needs torch, transformers and sentencepiece (scripts/requirements-llamacpp.txt;
default target/venv-llamacpp/bin/python). A 1B-class shape (random weights, SmolLM2's
tokenizer, which the converter needs, copied from --tokenizer-from):
  .venv/bin/python scripts/make_bench_checkpoint.py --config configs/bench-smollm2-1.7b.json \
      --out target/bench-smollm2-1.7b
  scripts/bench_llamacpp.py --model target/bench-smollm2-1.7b --name smollm2-1.7b-random
Writes target/bench_llamacpp-NAME-DATE.json and prints markdown tables.
"""
import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T = os.path.join(ROOT, "target")
LLAMA_VERSION = "0.3.36"  # keep in step with scripts/llamacpp_build.sh
LLAMA_SRC = os.path.join(T, "llama.cpp", "src", f"llama_cpp_python-{LLAMA_VERSION}", "vendor",
                         "llama.cpp")
LLAMA_BIN = os.path.join(T, "llama.cpp", "build", "bin")
OURS = os.environ.get("TINY_DECODER_BIN", os.path.join(ROOT, "target", "release", "tiny-decoder"))
PY = os.environ.get("LLAMACPP_PYTHON", os.path.join(T, "venv-llamacpp", "bin", "python"))
ENV = dict(os.environ, RAYON_NUM_THREADS="2")
LLAMA_ENV = dict(ENV)  # --omp-passive adds OMP_WAIT_POLICY
GGUF_TYPE = {"f32": "F32", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0"}


def sh(cmd, env=ENV):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r.stdout


def gguf_facts(path):
    """freq_base and {tensor type: count} of a GGUF, read with the vendored gguf-py."""
    code = ("import sys, json, collections; from gguf import GGUFReader; r = GGUFReader(sys.argv[1]);"
            "f = r.get_field('llama.rope.freq_base'); fb = float(f.parts[f.data[0]][0]) if f else None;"
            "c = collections.Counter(t.tensor_type.name for t in r.tensors);"
            "s = {t.name: t.tensor_type.name for t in r.tensors if 'blk.' not in t.name};"
            "print(json.dumps({'freq_base': fb, 'types': c, 'non_block': s}))")
    out = sh([PY, "-c", code, path], env=dict(ENV, PYTHONPATH=os.path.join(LLAMA_SRC, "gguf-py")))
    return json.loads(out)


def make_ggufs(model, name, dtypes, tokenizer_from):
    """target/llamacpp-models/NAME-D.gguf for each dtype (cached); returns {dtype: path}."""
    out_dir = os.path.join(T, "llamacpp-models")
    os.makedirs(out_dir, exist_ok=True)
    path = {d: os.path.join(out_dir, f"{name}-{d}.gguf") for d in GGUF_TYPE}
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    need_convert = [d for d in ("f32", "bf16") if not os.path.exists(path[d]) and
                    (d in dtypes or (d == "f32" and any(q in dtypes for q in ("q8_0", "q4_0"))))]
    if need_convert:
        with tempfile.TemporaryDirectory(dir=T) as tmp:
            for f in os.listdir(model):  # links to everything but config.json
                if f != "config.json":
                    os.symlink(os.path.abspath(os.path.join(model, f)), os.path.join(tmp, f))
            if not os.path.exists(os.path.join(model, "tokenizer.json")):
                for f in ("tokenizer.json", "tokenizer_config.json"):
                    os.symlink(os.path.abspath(os.path.join(tokenizer_from, f)),
                               os.path.join(tmp, f))
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(dict(cfg, rope_theta=theta), f, indent=2)
            for d in need_convert:
                print(f"converting {model} -> {path[d]}", file=sys.stderr)
                sh([PY, os.path.join(LLAMA_SRC, "convert_hf_to_gguf.py"), tmp, "--outtype", d,
                    "--outfile", path[d] + ".tmp"],
                   env=dict(ENV, PYTHONPATH=os.path.join(LLAMA_SRC, "gguf-py")))
                os.replace(path[d] + ".tmp", path[d])
    for d in ("q8_0", "q4_0"):
        if d in dtypes and not os.path.exists(path[d]):
            print(f"quantizing {path['f32']} -> {path[d]}", file=sys.stderr)
            sh([os.path.join(LLAMA_BIN, "llama-quantize"), path["f32"], path[d] + ".tmp",
                GGUF_TYPE[d], "2"])
            os.replace(path[d] + ".tmp", path[d])
    facts = {}
    for d in dtypes:
        facts[d] = gguf_facts(path[d])
        if abs(facts[d]["freq_base"] - theta) > 1e-3 * theta:
            sys.exit(f"{path[d]}: llama.rope.freq_base {facts[d]['freq_base']} != rope_theta "
                     f"{theta} of {model}; delete it and convert again")
    return path, facts


def run_llama(gguf, p, n, depth=0):
    out = sh([os.path.join(LLAMA_BIN, "llama-bench"), "-m", gguf, "-t", "2", "-r", "1",
              "-p", str(p), "-n", str(n), "-d", str(depth), "-o", "json"], env=LLAMA_ENV)
    res = {}
    for t in json.loads(out):
        key = "prefill_tokens_per_s" if t["n_prompt"] > 0 else "decode_tokens_per_s"
        res[key] = t["avg_ts"]
    return res


def run_ours(model, dtype, p, n):
    out = json.loads(sh([OURS, "bench", "-m", model, "--dtype", dtype, "--prompt-tokens", str(p),
                         "--new-tokens", str(n), "--json"]))
    return out


def cases(a):
    """(label, ours (P, N), llama.cpp runs [(p, n, depth)], which keys to report)."""
    c = [(f"{a.prompt_tokens}+{a.new_tokens}", (a.prompt_tokens, a.new_tokens),
          [(a.prompt_tokens, a.new_tokens, 0)], ["prefill_tokens_per_s", "decode_tokens_per_s"])]
    for p in a.prefill:
        c.append((f"prefill {p}", (p, 0), [(p, 0, 0)], ["prefill_tokens_per_s"]))
    for p in a.long:
        c.append((f"{p}+32 (decode)", (p, 32), [(0, 32, p)], ["decode_tokens_per_s"]))
    return c


def speed(a, ggufs):
    rows, raw = [], {}
    for label, (op, on), lruns, keys in cases(a):
        for d in a.dtypes:
            model = a.bf16_model if d == "bf16" and a.bf16_model else a.model
            ours, llama = [], []
            for r in range(a.rounds):
                for who in (("ours", "llama") if r % 2 == 0 else ("llama", "ours")):
                    if who == "ours":
                        ours.append(run_ours(model, d, op, on))
                    else:
                        res = {}
                        for p, n, depth in lruns:
                            res.update(run_llama(ggufs[d], p, n, depth))
                        llama.append(res)
            raw[f"{label} {d}"] = {"ours": ours, "llama.cpp": llama}
            for k in keys:
                o, l = [x[k] for x in ours], [x[k] for x in llama]
                row = {"case": label, "dtype": d, "metric": k.split("_")[0],
                       "ours": statistics.median(o), "ours_range": [min(o), max(o)],
                       "llama": statistics.median(l), "llama_range": [min(l), max(l)]}
                row["ratio"] = row["ours"] / row["llama"]
                if k == "decode_tokens_per_s":
                    row["ours_read_gb_per_s"] = statistics.median(
                        x["decode_read_gb_per_s"] for x in ours)
                rows.append(row)
                print(fmt_row(row), flush=True)
    return rows, raw


def fmt_row(r):
    return (f"| {r['case']} | {r['dtype']} | {r['metric']} | {r['ours']:.1f} "
            f"({r['ours_range'][0]:.0f}-{r['ours_range'][1]:.0f}) | {r['llama']:.1f} "
            f"({r['llama_range'][0]:.0f}-{r['llama_range'][1]:.0f}) | {r['ratio']:.2f}x |")


def perplexity(a, ggufs):
    res = {}
    for d in [d for d in ("f32", "q8_0", "q4_0") if d in a.dtypes]:
        out = subprocess.run([os.path.join(LLAMA_BIN, "llama-perplexity"), "-m", ggufs[d], "-f",
                              a.ppl_file, "-c", "512", "-b", "512", "-t", "2"],
                             capture_output=True, text=True, env=LLAMA_ENV)
        m = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
        if not m:
            sys.exit(f"llama-perplexity on {ggufs[d]} printed no estimate:\n{out.stderr[-2000:]}")
        chunks = re.search(r"calculating perplexity over (\d+) chunks", out.stderr)
        ours = json.loads(sh([OURS, "eval", "-m", a.model, "--dtype", d, "--file", a.ppl_file,
                              "--context", "512", "--stride", "256", "--json"]))
        res[d] = {"llama": float(m.group(1)), "llama_chunks": int(chunks.group(1)) if chunks
                  else None, "ours": ours["perplexity"], "ours_tokens": ours["tokens"]}
    for d, r in res.items():
        r["llama_vs_f32"] = r["llama"] / res["f32"]["llama"] - 1 if "f32" in res else None
        r["ours_vs_f32"] = r["ours"] / res["f32"]["ours"] - 1 if "f32" in res else None
        print(f"| {d} | {r['ours']:.4f} | {r['ours_vs_f32']:+.2%} | {r['llama']:.4f} | "
              f"{r['llama_vs_f32']:+.2%} |", flush=True)
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=os.path.join(T, "models", "smollm2-135m-instruct"))
    p.add_argument("--bf16-model", default=None,
                   help="our bf16 runs load this dir (default: MODEL-bf16 if it exists, "
                   "else --model with --dtype bf16)")
    p.add_argument("--name", default="smollm2-135m")
    p.add_argument("--tokenizer-from", default=os.path.join(T, "models", "smollm2-135m-instruct"))
    p.add_argument("--dtypes", default="f32,bf16,q8_0,q4_0")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prefill", default="", help="extra prefill-only cases, e.g. 512,2000")
    p.add_argument("--long", default="", help="decode after a P-token prompt, e.g. 2000")
    p.add_argument("--perplexity", action="store_true")
    p.add_argument("--ppl-file", default=os.path.join(ROOT, "tests", "data",
                                                       "shakespeare-heldout.txt"))
    p.add_argument("--ppl-chars", type=int, default=0,
                   help="score only the file's first N characters (0: all)")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--omp-passive", action="store_true",
                   help="OMP_WAIT_POLICY=passive for llama.cpp (a loaded host: its spinning "
                   "OpenMP threads otherwise collapse, e.g. q4_0 decode 4 vs 60 tok/s)")
    a = p.parse_args()
    a.dtypes = a.dtypes.split(",")
    if a.bf16_model is None and os.path.isdir(a.model.rstrip("/") + "-bf16"):
        a.bf16_model = a.model.rstrip("/") + "-bf16"
    a.prefill = [int(x) for x in a.prefill.split(",") if x]
    a.long = [int(x) for x in a.long.split(",") if x]
    subprocess.run([os.path.join(ROOT, "scripts", "llamacpp_build.sh")], check=True)
    if a.omp_passive:
        LLAMA_ENV["OMP_WAIT_POLICY"] = "passive"
    if a.ppl_chars:
        with open(a.ppl_file, encoding="utf-8") as f:
            text = f.read()[:a.ppl_chars]
        a.ppl_file = os.path.join(T, f"ppl-{a.ppl_chars}-" + os.path.basename(a.ppl_file))
        with open(a.ppl_file, "w", encoding="utf-8") as f:
            f.write(text)
    ggufs, facts = make_ggufs(a.model, a.name, a.dtypes, a.tokenizer_from)
    for d in a.dtypes:
        print(f"{d}: {os.path.basename(ggufs[d])} tensors {facts[d]['types']} "
              f"non-block {facts[d]['non_block']}")
    with open("/proc/loadavg") as f:
        load_start = f.read().split()[:3]
    started = datetime.datetime.now()
    report = {"date": started.isoformat(timespec="seconds"), "host": platform.node(),
              "cpu": cpu_name(), "load_start": load_start, "rounds": a.rounds,
              "llama_cpp": f"llama-cpp-python {LLAMA_VERSION} sdist (vendor/llama.cpp)",
              "ours": OURS, "model": a.model, "gguf": facts,
              "llama_omp_wait_policy": LLAMA_ENV.get("OMP_WAIT_POLICY", "(default)"),
              "ppl_file": a.ppl_file}
    if not a.skip_speed:
        print("\n| case | dtype | tok/s | ours median (min-max) | llama.cpp median (min-max) "
              "| ours / llama.cpp |\n|---|---|---|---|---|---|")
        report["speed"], report["raw"] = speed(a, ggufs)
    if a.perplexity:
        print(f"\nperplexity of {os.path.relpath(a.ppl_file, ROOT)}\n"
              "| dtype | ours | vs f32 | llama.cpp | vs f32 |\n|---|---|---|---|---|")
        report["perplexity"] = perplexity(a, ggufs)
    with open("/proc/loadavg") as f:
        report["load_end"] = f.read().split()[:3]
    report["seconds"] = (datetime.datetime.now() - started).total_seconds()
    out = os.path.join(T, f"bench_llamacpp-{a.name}-{started:%Y%m%d-%H%M%S}.json")
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nload {report['load_start']} -> {report['load_end']}, {report['seconds']:.0f} s; "
          f"wrote {out}")


def cpu_name():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


if __name__ == "__main__":
    main()
