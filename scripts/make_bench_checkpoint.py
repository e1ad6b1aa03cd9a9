#!/usr/bin/env python3
"""Random-init LlamaForCausalLM of SmolLM-135M's shape, saved for the side-by-side benchmark.

Reads configs/bench-smollm135m.json (tied embeddings), seeds torch, initialises the model with
transformers' own init, and save_pretrained()s it as float32 safetensors into
target/bench-smollm135m/ (git-ignored). No tokenizer is written: every runner in
scripts/bench_compare.py feeds synthetic ids ((i * 7919 + 13) % vocab), so none needs one.

usage: .venv/bin/python scripts/make_bench_checkpoint.py [--out target/bench-smollm135m] [--seed 0]
"""
import argparse
import json
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "bench-smollm135m.json"))
    p.add_argument("--out", default=os.path.join(ROOT, "target", "bench-smollm135m"))
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    with open(a.config) as f:
        raw = json.load(f)
    raw.pop("architectures", None)
    raw.pop("model_type", None)
    raw.pop("torch_dtype", None)
    raw["tie_word_embeddings"] = True
    cfg = LlamaConfig(**raw)
    torch.manual_seed(a.seed)
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    os.makedirs(a.out, exist_ok=True)
    model.save_pretrained(a.out, safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {a.out}: {n} parameters (float32, tied), seed {a.seed}")
    print(sorted(os.listdir(a.out)))


if __name__ == "__main__":
    main()
