#!/usr/bin/env python3
"""A `tiny-decoder convert` directory through transformers: the same mean NLL as ours.

    check_convert_hf.py DIR TEXT_FILE [--original ORIGINAL_DIR] [--bin tiny-decoder] [--tol 2e-4]

Loads DIR with transformers' AutoModelForCausalLM (float32, CPU), which must find every
tensor it expects and no other (a wrong shape or a missing tensor is a failure, not a random
initialisation), and computes the mean NLL of TEXT_FILE teacher-forced in one window:
`tokenizer(text)["input_ids"]`, `model(ids, labels=ids).loss`. Then runs our
`tiny-decoder eval -m DIR --file TEXT_FILE --json` and compares: same number of predicted
tokens, mean NLL within --tol. With --original, also transformers' NLL of the unconverted
checkpoint, to show what the conversion cost. Prints one JSON object; exits 1 on a mismatch.

Needs torch and transformers: scripts/requirements-smollm2-reference.txt, the venv .ci/run
makes (target/venv-reference) and points TINY_DECODER_PYTHON at for tests/convert_out.rs. TEXT_FILE must fit one window of the
model's context (ours scores longer files in windows, transformers here does not).
"""

import argparse
import json
import subprocess
import sys

import torch
import transformers


def transformers_nll(model_dir, text):
    """(predicted tokens, mean NLL) of text under model_dir, as transformers computes them."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True
    )
    bad = {k: v for k, v in info.items() if v}
    if bad:
        sys.exit(f"{model_dir}: transformers did not load every tensor as written: {bad}")
    model.eval()
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        loss = model(ids, labels=ids).loss
    return ids.shape[1] - 1, loss.item()


def ours_nll(binary, model_dir, text_file):
    out = subprocess.run(
        [binary, "eval", "-m", model_dir, "--file", text_file, "--json"],
        check=True,
        capture_output=True,
        text=True,
    )
    report = json.loads(out.stdout)
    return report["tokens"], report["mean_nll"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dir")
    p.add_argument("text_file")
    p.add_argument("--original", help="the unconverted checkpoint, for the NLL it had")
    p.add_argument("--bin", default="target/debug/tiny-decoder")
    p.add_argument("--tol", type=float, default=2e-4)
    a = p.parse_args()
    text = open(a.text_file, encoding="utf-8").read()
    tokens, theirs = transformers_nll(a.dir, text)
    our_tokens, ours = ours_nll(a.bin, a.dir, a.text_file)
    report = {
        "dir": a.dir,
        "tokens": tokens,
        "transformers_mean_nll": theirs,
        "ours_mean_nll": ours,
        "abs_diff": abs(theirs - ours),
        "tol": a.tol,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }
    if a.original:
        report["original_transformers_mean_nll"] = transformers_nll(a.original, text)[1]
    print(json.dumps(report))
    if our_tokens != tokens:
        sys.exit(f"token counts differ: ours {our_tokens}, transformers {tokens}")
    if not abs(theirs - ours) <= a.tol:
        sys.exit(f"mean NLL differs by {abs(theirs - ours):.3g} (> {a.tol}): ours {ours}, transformers {theirs}")


if __name__ == "__main__":
    main()
