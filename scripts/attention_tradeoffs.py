"""The README's attention conversion trade-off table, for real checkpoints.

For each model and each `--attention` spec (plus the original, unconverted): the method the
conversion used, KV bytes per token (default dtype, the checkpoint's: f32 for both) and its
ratio to the original's, perplexity on a held-out text and ΔNLL in nats against the original
(`eval`, which also reports the KV bytes and the conversion's seconds: one run each, they
are deterministic), what 1 GB of that cache holds (tokens of context, sequences of 4,096),
and decode tok/s at a long context (`bench`, medians of `--rounds` rounds that alternate
over the specs, so machine noise hits every spec alike), and at a longer one where the
model has it. Every conversion calibrates on the program's default text,
data/calibration.txt.

- smollm2: SmolLM2-135M-Instruct, held out tests/data/passage.txt, bench 2000 + 32 and
  6000 + 32 tokens.
- stories260k: stories260K (context 512), held out tests/data/stories-heldout.txt (children's
  prose written for this repo in the TinyStories style, not from its training data),
  bench 480 + 31 tokens.

A spec ending in "+heal" (`mqa+heal`) is converted once with `convert --heal` into
target/healed/ and that checkpoint is evaluated and benched as it is; its conversion and
healing seconds are convert's.

With `--serve P` (smollm2: its context holds 16 × P), one more column: every available spec
served to 16 streams of ~P-token prompts at once, warm rounds over their cached prompts,
alternating over the specs (`scripts/bench_serve.py --long P`, all servers up together): the
aggregate decode, where a smaller cache is read by every stream at every step. A spec converted
at load for eval and bench is written once with `convert` into target/tradeoffs/ for it.

A spec the binary refuses (non-zero exit) is listed as "not available" with its error, so
the script can be re-run with a newer binary. Standard library only; from the repo root:

    python3 scripts/attention_tradeoffs.py [--bin target/release/tiny-decoder] [--rounds 3]
        [--models smollm2,stories260k] [--specs 'mqa;lowrank:128,method=svd']
        [--dir smollm2=PATH] [--serve 3000 [--serve-rounds 2]] [--json-out FILE]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

MODELS = {
    "smollm2": {
        "dir": "target/models/smollm2-135m-instruct",
        "heldout": "tests/data/passage.txt",
        "bench": (2000, 32),
        "long": (6000, 32),
        "specs": ["original", "mha", "mqa,method=mean", "mqa", "lowrank:384", "lowrank:256",
                  "lowrank:128", "lowrank:128,method=svd", "lowrank:64", "mla:64,rope=64",
                  "mla:192,rope=64", "mla:192,rope=192", "mqa+heal", "lowrank:128+heal",
                  "mla:64,rope=64+heal"],
    },
    "stories260k": {
        "dir": "../shared/checkpoints/stories260K",
        "heldout": "tests/data/stories-heldout.txt",
        "bench": (480, 31),
        "long": None,
        "specs": ["original", "mha", "gqa:2,method=mean", "gqa:2", "mqa,method=mean", "mqa",
                  "lowrank:64", "lowrank:32", "lowrank:16", "lowrank:16,method=svd",
                  "mla:16,rope=8", "gqa:2+heal", "mqa+heal", "lowrank:16+heal", "mla:16,rope=8+heal"],
    },
}


def run(binary, command, model_dir, spec, *args):
    """One command's JSON, or (None, its error line) when the binary refuses it."""
    attention = [] if spec == "original" else ["--attention", spec]
    out = subprocess.run([binary, command, "--model", model_dir, *attention, *args, "--json"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines() or [f"exit status {out.returncode}"]
        return None, lines[-1].removeprefix("error: ").replace("|", "\\|")
    return json.loads(out.stdout), None


def healed(binary, model_dir, spec, name):
    """A "SPEC+heal" row: `convert --heal` once into target/, whose directory is then run
    unconverted; (directory, convert's report) or (None, its error line)."""
    out = os.path.join("target", "healed", f"{name}-{spec}")
    shutil.rmtree(out, ignore_errors=True)
    report, err = run(binary, "convert", model_dir, spec.removesuffix("+heal"), "--heal",
                      "--out", out)
    return (out, report) if err is None else (None, err)


def measure(binary, name, model, model_dir, specs, rounds):
    """Every spec's eval, then `rounds` alternating benches; one dict per spec."""
    rows = {}
    for spec in specs:
        where, run_spec, heal = model_dir, spec, None
        if spec.endswith("+heal"):
            where, heal = healed(binary, model_dir, spec, name)
            run_spec = "original"
        if where is None:
            rows[spec] = {"spec": spec, "error": heal, "eval": None, "decode_tokens_per_s": [],
                          "long_decode_tokens_per_s": []}
            continue
        ev, err = run(binary, "eval", where, run_spec, "--file", model["heldout"])
        if ev is not None and heal is not None:
            for key in ("conversion_method", "conversion_secs", "heal_secs"):
                ev[key] = heal[key]
        rows[spec] = {"spec": spec, "error": err, "eval": ev, "decode_tokens_per_s": [],
                      "long_decode_tokens_per_s": [], "dir": where, "run_spec": run_spec}
    lengths = [("decode_tokens_per_s", model["bench"])]
    if model["long"]:
        lengths.append(("long_decode_tokens_per_s", model["long"]))
    for _ in range(rounds):
        for key, (prompt, new) in lengths:
            for spec in specs:
                if rows[spec]["error"] is None:
                    r, err = run(binary, "bench", rows[spec]["dir"], rows[spec]["run_spec"],
                                 "--prompt-tokens", str(prompt), "--new-tokens", str(new))
                    if err is not None:
                        rows[spec]["error"] = err
                    else:
                        rows[spec][key].append(r["decode_tokens_per_s"])
    return rows


def served(binary, name, model_dir, rows, prompt, rounds):
    """`--serve P`: each available spec's checkpoint served to 16 streams of ~P-token prompts
    (`bench_serve.py --long P`); its warm aggregate decode tok/s into rows[spec]["serve"]."""
    dirs = {}
    for spec, r in rows.items():
        if r["error"] is not None:
            continue
        if spec == "original" or r["run_spec"] == "original":
            dirs[spec] = r["dir"]
            continue
        out = os.path.join("target", "tradeoffs", f"{name}-{spec}")
        shutil.rmtree(out, ignore_errors=True)
        _, err = run(binary, "convert", model_dir, spec, "--out", out)
        if err is None:
            dirs[spec] = out
        else:
            r["serve_error"] = err
    paths = list(dirs.values())
    compare = [arg for p in paths[1:] for arg in ("--compare", p)]
    out = subprocess.run([sys.executable, os.path.join(HERE, "bench_serve.py"), "--long",
                          str(prompt), "--model", paths[0], *compare, "--rounds", str(rounds)],
                         capture_output=True, text=True, env=dict(os.environ,
                                                                  TINY_DECODER_BIN=binary))
    written = [line.split("written ", 1)[1] for line in out.stderr.splitlines()
               if line.startswith("written ")]
    if out.returncode != 0 or not written:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        sys.exit(f"bench_serve.py --long {prompt} failed: {tail}")
    with open(written[-1]) as f:
        report = json.load(f)["models"]
    for spec, d in dirs.items():
        rows[spec]["serve"] = report[d]["warm_aggregate_tok_s"]


def table(name, model, rows, serve=None):
    """The Markdown table of one model: ratios against its "original" row."""
    prompt, new = model["bench"]
    base = rows["original"]
    base_kv = base["eval"]["kv_bytes_per_token"]
    base_nll = base["eval"]["mean_nll"]
    dtype = base["eval"]["dtype"]
    long = model["long"]

    def speed(r, key):
        """Median decode tok/s and its ratio to the original's, as a cell."""
        if not r[key]:
            return "—"
        s, b = statistics.median(r[key]), statistics.median(base[key])
        return f"{s:.1f} ({s / b:.2f}×)"

    long_head = f"decode tok/s at {long[0] + long[1]} (vs original) | " if long else ""
    serve_head = (f"served, 16 streams of ~{serve} positions: aggregate tok/s (vs original) | "
                  if serve else "")
    lines = [f"| model | spec | method | KV bytes per token ({dtype}) | KV vs original | "
             f"1 GB of KV holds: tokens / 4k sequences | perplexity | ΔNLL (nats) | "
             f"decode tok/s at {prompt + new} positions (vs original) | {long_head}{serve_head}"
             f"conversion (s) | of which healing (s) |",
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if long else "")
             + ("---|" if serve else "") + "---|---|"]
    for spec, r in rows.items():
        if r["error"] is not None:
            empty = "|" * (7 + bool(long) + bool(serve))
            lines.append(f"| {name} | {spec} | not available: {r['error']} {empty}|")
            continue
        ev = r["eval"]
        kv = ev["kv_bytes_per_token"]
        method = ev.get("conversion_method", "—")
        secs = f"{ev['conversion_secs']:.2f}" if "conversion_secs" in ev else "—"
        heal = f"{ev['heal_secs']:.2f}" if "heal_secs" in ev else "—"
        long_cell = f"{speed(r, 'long_decode_tokens_per_s')} | " if long else ""
        serve_cell = ""
        if serve:
            got, b = r.get("serve"), base.get("serve")
            serve_cell = (f"{got:.1f} ({got / b:.2f}×) | " if got and b
                          else f"— {r.get('serve_error', '')} | ")
        lines.append(f"| {name} | {spec} | {method} | {kv:,} | {kv / base_kv:.3f} | "
                     f"{10**9 // kv:,} / {10**9 // kv // 4096:,} | {ev['perplexity']:.2f} | "
                     f"{ev['mean_nll'] - base_nll:+.4f} | {speed(r, 'decode_tokens_per_s')} | "
                     f"{long_cell}{serve_cell}{secs} | {heal} |")
    return "\n".join(lines)


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/tiny-decoder")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", default="smollm2,stories260k")
    ap.add_argument("--specs", help="';'-separated specs for every model, instead of its list")
    ap.add_argument("--dir", action="append", default=[], metavar="MODEL=PATH",
                    help="where a model's checkpoint is, instead of the default")
    ap.add_argument("--serve", type=int, default=0, metavar="P",
                    help="also serve each spec to 16 streams of ~P-token prompts (smollm2)")
    ap.add_argument("--serve-rounds", type=int, default=2)
    ap.add_argument("--json-out", help="also write every measurement here")
    a = ap.parse_args()
    dirs = dict(d.split("=", 1) for d in a.dir)
    start, load_start = time.time(), loadavg()
    results = {}
    for name in a.models.split(","):
        model = MODELS[name]
        specs = a.specs.split(";") if a.specs else model["specs"]
        specs = ["original"] + [s for s in specs if s != "original"]
        model_dir = dirs.get(name, model["dir"])
        rows = measure(a.bin, name, model, model_dir, specs, a.rounds)
        serve = a.serve if a.serve and model["long"] else None
        if serve:
            served(a.bin, name, model_dir, rows, serve, a.serve_rounds)
        results[name] = rows
        print(table(name, model, rows, serve) + "\n", flush=True)
    print(f"load average (1, 5, 15 min): {load_start} at start, {loadavg()} at end; "
          f"{a.rounds} rounds, {time.time() - start:.0f} s in all")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
