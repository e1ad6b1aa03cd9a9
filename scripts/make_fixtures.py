#!/usr/bin/env python3
"""Generate the reference fixtures used by tiny-decoder's integration tests.

Everything here is produced with Hugging Face `transformers` (the reference
implementation) and `tokenizers`, in float32 on the CPU, deterministically
(fixed seeds).  Rerunning the script overwrites `tests/fixtures/` and
`tests/data/stories260k_reference.json` with identical content (given the same
library versions, see scripts/requirements.txt).

How to rerun (from the repository root):

    python -m venv .venv
    .venv/bin/pip install -r scripts/requirements.txt   # or: torch transformers tokenizers safetensors
    .venv/bin/python scripts/make_fixtures.py

What it writes
--------------
tests/fixtures/<name>/   for each tiny random-init model (see FIXTURES below):
    config.json            as written by transformers 5 (`rope_parameters`), or
                           rewritten into the older hub layout (top-level
                           `rope_theta` + `rope_scaling`) for some fixtures
    model.safetensors      float32 weights (save_pretrained, safe_serialization)
    generation_config.json as written by save_pretrained (qwen3-qknorm: eos list)
    tokenizer.json         the shared byte-level BPE tokenizer
    reference.json         prompt / prompt_ids / logits (T x vocab) /
                           greedy_ids (manual argmax loop, 24 tokens, no EOS stop) /
                           generate_ids (model.generate, stops at EOS) /
                           eval_text / eval_ids / mean_nll, plus some diagnostics
tests/data/stories260k_reference.json
    reference outputs of the real stories260K checkpoint, which is read from
    ../shared/checkpoints/stories260K (or $STORIES260K_DIR) and never copied.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

import tokenizers  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()

REPO = Path(__file__).resolve().parent.parent
FIXTURES_DIR = REPO / "tests" / "fixtures"
DATA_DIR = REPO / "tests" / "data"
STORIES_DIR = Path(
    os.environ.get("STORIES260K_DIR", REPO.parent / "shared" / "checkpoints" / "stories260K")
)

PROMPT = "The quick brown fox jumps over"
EVAL_TEXT = (
    "The old lighthouse keeper climbed the narrow stairs every evening to light the lamp. "
    "Ships passing in the night could see its warm glow from many miles away."
)
N_GREEDY = 24
MIN_LOGIT_GAP = 2e-3  # top-1 minus top-2 logit at every greedy step
MIN_ROUTER_GAP = 5e-4  # margin of every discrete MoE routing decision

# Small embedded training corpus for the shared tokenizer.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A small engine reads the weights of a model and
predicts the next token, one step at a time. Every token is a small piece of text, and the model
turns a sequence of tokens into a probability for each possible next token.

Once upon a time there was a little town by the sea. The people of the town were fishermen, and
every morning they sailed out with their boats before the sun came up. In the evening they came
back with their nets full of fish, and the children ran down to the harbor to meet them.

The old lighthouse stood on the rocks at the end of the harbor. Its keeper was a quiet man who
loved to read books about the stars. He said that the light was there to guide the ships home,
and that a good light must never go out, not even on the darkest and stormiest night.

Language models are trained on large amounts of text. They learn which words tend to follow
other words, and they use attention to look back at everything that came before. A decoder only
transformer has many layers, and each layer has an attention block and a feed forward block.
Rotary position embeddings tell the model where each token is in the sequence.

In the spring the fields were green and the trees were full of birds. The farmer walked along the
river with his dog, and they watched the water flow slowly towards the sea. It was a good year,
and everyone in the village was happy, because the harvest was going to be rich.
"""

# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------

BOS, EOS = "<s>", "</s>"


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        min_frequency=2,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    assert (bos_id, eos_id) == (0, 1), (bos_id, eos_id)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    return tok


# ---------------------------------------------------------------------------
# Fixture definitions
# ---------------------------------------------------------------------------

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.15,
    bos_token_id=0,
    eos_token_id=1,
)


def fixture_specs(vocab: int):
    """name -> (config class, model class, config kwargs, options)."""
    v8 = int(math.ceil(vocab / 8) * 8)
    specs = {
        "llama-mha-tied": (
            LlamaConfig,
            LlamaForCausalLM,
            dict(
                COMMON,
                vocab_size=v8,
                num_attention_heads=4,
                num_key_value_heads=4,
                tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            ),
            dict(seed=1),
        ),
        "llama-mqa-llama3": (
            LlamaConfig,
            LlamaForCausalLM,
            dict(
                COMMON,
                vocab_size=v8,
                num_attention_heads=4,
                num_key_value_heads=1,
                tie_word_embeddings=False,
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            ),
            dict(seed=2, old_layout={"rope_type": "llama3"}, eos_list_in="config"),
        ),
        "mistral-gqa-headdim": (
            MistralConfig,
            MistralForCausalLM,
            dict(
                COMMON,
                vocab_size=v8,
                num_attention_heads=8,
                num_key_value_heads=2,
                head_dim=32,
                sliding_window=None,
                tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            ),
            dict(seed=3),
        ),
        "qwen2-bias": (
            Qwen2Config,
            Qwen2ForCausalLM,
            dict(
                COMMON,
                # Padded vocabulary (larger than the tokenizer's), like real Qwen checkpoints.
                vocab_size=v8 + 8,
                num_attention_heads=4,
                num_key_value_heads=2,
                tie_word_embeddings=True,
                use_sliding_window=False,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            ),
            dict(seed=4, fill_bias=True, old_layout={}),
        ),
        "qwen3-qknorm": (
            Qwen3Config,
            Qwen3ForCausalLM,
            dict(
                COMMON,
                vocab_size=v8,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=32,
                tie_word_embeddings=False,
                use_sliding_window=False,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            ),
            dict(seed=5, eos_list_in="generation_config"),
        ),
        "llama-linear-rope": (
            LlamaConfig,
            LlamaForCausalLM,
            dict(
                COMMON,
                vocab_size=v8,
                num_attention_heads=4,
                num_key_value_heads=2,
                attention_bias=True,
                tie_word_embeddings=False,
                rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
            ),
            dict(seed=6, fill_bias=True),
        ),
        "llama-yarn": (
            LlamaConfig,
            LlamaForCausalLM,
            dict(
                COMMON,
                vocab_size=v8,
                num_attention_heads=4,
                num_key_value_heads=2,
                tie_word_embeddings=False,
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            ),
            dict(seed=7, old_layout={"type": "yarn"}),
        ),
        "deepseek-v2": (
            DeepseekV2Config,
            DeepseekV2ForCausalLM,
            dict(
                COMMON,
                vocab_size=v8,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=4,
                q_lora_rank=None,
                kv_lora_rank=32,
                qk_nope_head_dim=16,
                qk_rope_head_dim=8,
                v_head_dim=16,
                first_k_dense_replace=1,
                n_routed_experts=8,
                num_experts_per_tok=2,
                n_shared_experts=1,
                moe_intermediate_size=32,
                topk_method="greedy",
                n_group=None,
                topk_group=None,
                norm_topk_prob=False,
                routed_scaling_factor=1.0,
                tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            ),
            dict(seed=8, gate_std=0.3, old_layout={}),
        ),
        "deepseek-v3": (
            DeepseekV3Config,
            DeepseekV3ForCausalLM,
            dict(
                COMMON,
                vocab_size=v8,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=4,
                q_lora_rank=24,
                kv_lora_rank=32,
                qk_nope_head_dim=16,
                qk_rope_head_dim=8,
                v_head_dim=16,
                first_k_dense_replace=1,
                n_routed_experts=8,
                num_experts_per_tok=2,
                n_shared_experts=1,
                moe_intermediate_size=32,
                n_group=4,
                topk_group=2,
                norm_topk_prob=True,
                routed_scaling_factor=2.5,
                rope_interleave=True,
                num_mtp_layers=0,
                tie_word_embeddings=False,
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                },
            ),
            dict(seed=9, gate_std=0.3, e_bias_std=0.5),
        ),
    }
    return specs


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def f32_list(t: torch.Tensor):
    return [float(x) for x in t.detach().to(torch.float32).reshape(-1).tolist()]


def perturb(model: torch.nn.Module, opts: dict, gen: torch.Generator) -> None:
    """Make every parameter matter: non-trivial norms, non-zero biases, decisive routers."""
    with torch.no_grad():
        for name, mod in model.named_modules():
            cls = type(mod).__name__
            if cls.endswith("RMSNorm"):
                mod.weight.copy_(1.0 + 0.1 * torch.randn(mod.weight.shape, generator=gen))
            elif isinstance(mod, torch.nn.Linear) and mod.bias is not None:
                mod.bias.copy_(0.1 * torch.randn(mod.bias.shape, generator=gen))
            elif cls.endswith("TopkRouter"):
                mod.weight.copy_(opts.get("gate_std", 0.3) * torch.randn(mod.weight.shape, generator=gen))
                if hasattr(mod, "e_score_correction_bias"):
                    mod.e_score_correction_bias.copy_(
                        opts.get("e_bias_std", 0.5) * torch.randn(mod.e_score_correction_bias.shape, generator=gen)
                    )


class RouterMonitor:
    """Records the smallest margin of every discrete routing decision (top-k experts / groups)."""

    def __init__(self, model):
        self.min_gap = math.inf
        self.handles = []
        for mod in model.modules():
            if type(mod).__name__.endswith("TopkRouter"):
                self.handles.append(mod.register_forward_hook(self.hook))

    def hook(self, mod, inputs, output):
        router_logits = output[0].float()
        k = mod.top_k
        if type(mod).__name__.startswith("DeepseekV3"):
            scores = router_logits.sigmoid() + mod.e_score_correction_bias
            ng, tg = mod.num_group, mod.topk_group
            per = mod.num_experts // ng
            gs = scores.view(-1, ng, per).topk(2, dim=-1)[0].sum(-1)
            gs_sorted = gs.sort(dim=-1, descending=True).values
            self.min_gap = min(self.min_gap, (gs_sorted[:, tg - 1] - gs_sorted[:, tg]).min().item())
            idx = gs.topk(tg, dim=-1)[1]
            mask = torch.zeros_like(gs).scatter_(1, idx, 1).bool()
            mask = mask.unsqueeze(-1).expand(-1, ng, per).reshape(-1, mod.num_experts)
            choice = scores.masked_fill(~mask, float("-inf")).sort(dim=-1, descending=True).values
        else:
            assert mod.topk_method == "greedy"
            choice = router_logits.softmax(-1).sort(dim=-1, descending=True).values
        self.min_gap = min(self.min_gap, (choice[:, k - 1] - choice[:, k]).min().item())

    def remove(self):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def greedy_loop(model, prompt_ids: list[int], n: int):
    """Manual greedy decoding: full recomputation each step, argmax, no EOS stop."""
    ids = list(prompt_ids)
    gaps = []
    for _ in range(n):
        logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
        top2 = logits.topk(2)
        gaps.append((top2.values[0] - top2.values[1]).item())
        ids.append(int(top2.indices[0]))
    return ids[len(prompt_ids):], gaps


@torch.no_grad()
def generate_ids(model, prompt_ids: list[int], n: int) -> list[int]:
    inp = torch.tensor([prompt_ids])
    out = model.generate(
        inp,
        attention_mask=torch.ones_like(inp),
        max_new_tokens=n,
        do_sample=False,
        pad_token_id=model.config.bos_token_id,
    )
    return out[0, len(prompt_ids):].tolist()


@torch.no_grad()
def full_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids]), use_cache=False).logits[0].float()


@torch.no_grad()
def mean_nll(model, ids: list[int]) -> float:
    t = torch.tensor([ids])
    return model(t, labels=t, use_cache=False).loss.item()


def load(path: Path):
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return m.eval()


def to_old_layout(cfg_path: Path, type_key: dict) -> dict:
    """Rewrite a transformers-5 config.json into the older hub layout:
    top-level `rope_theta` and `rope_scaling` (null for plain RoPE), no `rope_parameters`."""
    cfg = json.loads(cfg_path.read_text())
    rp = dict(cfg.pop("rope_parameters"))
    rope_theta = rp.pop("rope_theta")
    rope_type = rp.pop("rope_type")
    new = {}
    for k, v in cfg.items():
        new[k] = v
        if k == "rms_norm_eps":  # keep the keys roughly where old configs had them
            new["rope_theta"] = rope_theta
            if rope_type == "default":
                new["rope_scaling"] = None
            else:
                key = next(iter(type_key))
                new["rope_scaling"] = {key: rope_type, **rp}
    assert "rope_theta" in new
    cfg_path.write_text(json.dumps(new, indent=2, sort_keys=False) + "\n")
    return new


def pick_stop_token(greedy: list[int], bos: int, eos: int) -> int | None:
    """A token that first appears in the greedy continuation at step >= 8 (so an EOS list containing it
    makes model.generate stop early, while the manual loop keeps going)."""
    for i in range(8, len(greedy) - 2):
        t = greedy[i]
        if t not in greedy[:i] and t not in (bos, eos):
            return t
    return None


# ---------------------------------------------------------------------------
# Fixture generation
# ---------------------------------------------------------------------------


def make_fixture(name, cfg_cls, model_cls, cfg_kwargs, opts, tok: Tokenizer, prompt_ids, eval_ids):
    out = FIXTURES_DIR / name
    tok_vocab = tok.get_vocab_size()
    base_seed = opts["seed"]
    for attempt in range(100):
        seed = base_seed + 1000 * attempt
        torch.manual_seed(seed)
        config = cfg_cls(**cfg_kwargs)
        config._attn_implementation = "eager"
        model = model_cls(config).to(torch.float32).eval()
        gen = torch.Generator().manual_seed(seed + 12345)
        perturb(model, opts, gen)

        mon = RouterMonitor(model)
        logits = full_logits(model, prompt_ids)
        greedy, gaps = greedy_loop(model, prompt_ids, N_GREEDY)
        nll = mean_nll(model, eval_ids)
        mon.remove()
        ok = min(gaps) > MIN_LOGIT_GAP and all(t < tok_vocab for t in greedy)
        ok = ok and (mon.min_gap > MIN_ROUTER_GAP)
        if opts.get("eos_list_in"):
            ok = ok and pick_stop_token(greedy, 0, 1) is not None
        if ok:
            break
        print(f"  {name}: seed {seed} rejected (min logit gap {min(gaps):.2e}, router gap {mon.min_gap:.2e})")
    else:
        raise RuntimeError(f"{name}: no acceptable seed found")

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save(str(out / "tokenizer.json"))
    new_layout_config = json.loads((out / "config.json").read_text())

    # Reload what was saved and check it reproduces the in-memory model exactly.
    m2 = load(out)
    assert torch.equal(full_logits(m2, prompt_ids), logits), f"{name}: reload mismatch"

    notes = []
    stop_tok = None
    if opts.get("eos_list_in"):
        stop_tok = pick_stop_token(greedy, 0, 1)
        eos_list = [1, stop_tok]
        if opts["eos_list_in"] == "config":
            cfg = json.loads((out / "config.json").read_text())
            cfg["eos_token_id"] = eos_list
            (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
            gpath = out / "generation_config.json"
            if gpath.exists():
                g = json.loads(gpath.read_text())
                g["eos_token_id"] = eos_list
                gpath.write_text(json.dumps(g, indent=2) + "\n")
            notes.append(f"config.json eos_token_id is a list {eos_list}; generate stops at token {stop_tok}")
        else:
            gpath = out / "generation_config.json"
            g = json.loads(gpath.read_text()) if gpath.exists() else {"_from_model_config": False}
            g["_from_model_config"] = False
            g["bos_token_id"] = 0
            g["eos_token_id"] = eos_list
            gpath.write_text(json.dumps(g, indent=2) + "\n")
            notes.append(
                f"config.json eos_token_id is 1 but generation_config.json eos_token_id is {eos_list}; "
                f"generate stops at token {stop_tok}"
            )

    if "old_layout" in opts:
        to_old_layout(out / "config.json", opts["old_layout"] or {"type": "default"})
        notes.append("config.json rewritten to the old layout (top-level rope_theta / rope_scaling)")

    # Reference numbers come from the model transformers loads from the final directory.
    m3 = load(out)
    logits3 = full_logits(m3, prompt_ids)
    assert torch.equal(logits3, logits), f"{name}: final config reload changed logits"
    if "old_layout" in opts:
        rp_old = {k: v for k, v in m3.config.rope_parameters.items() if k != "type"}
        assert rp_old == model.config.rope_parameters, (m3.config.rope_parameters, model.config.rope_parameters)
    greedy3, gaps3 = greedy_loop(m3, prompt_ids, N_GREEDY)
    assert greedy3 == greedy
    gen_ids = generate_ids(m3, prompt_ids, N_GREEDY)
    nll3 = mean_nll(m3, eval_ids)
    assert nll3 == nll, (nll3, nll)
    if gen_ids != greedy:
        notes.append(
            f"generate_ids differs from greedy_ids: generate stopped after {len(gen_ids)} tokens "
            f"(EOS {gen_ids[-1]}); it is a prefix of greedy_ids: {greedy[: len(gen_ids)] == gen_ids}"
        )
    else:
        notes.append("generate_ids == greedy_ids (no EOS produced)")

    ref = {
        "fixture": name,
        "model_class": model_cls.__name__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "seed": seed,
        "prompt": PROMPT,
        "prompt_ids": prompt_ids,
        "vocab_size": m3.config.vocab_size,
        "logits": [f32_list(row) for row in logits],
        "greedy_ids": greedy,
        "greedy_text": tok.decode(greedy, skip_special_tokens=False),
        "greedy_min_top2_gap": min(gaps),
        "generate_ids": gen_ids,
        "eval_text": EVAL_TEXT,
        "eval_ids": eval_ids,
        "mean_nll": nll,
        "notes": notes,
    }
    if "old_layout" in opts:
        # What transformers 5 itself wrote before the rewrite (same model, new layout).
        ref["config_new_layout"] = new_layout_config
    if mon.min_gap != math.inf:
        ref["router_min_margin"] = mon.min_gap
    (out / "reference.json").write_text(json.dumps(ref) + "\n")
    print(
        f"  {name}: seed {seed}, min top2 gap {min(gaps):.3g}, "
        f"router margin {mon.min_gap:.3g}, nll {nll:.4f}, generate {len(gen_ids)} tokens"
    )
    return new_layout_config


def make_stories_reference():
    src = STORIES_DIR
    if not (src / "model.safetensors").exists():
        print(f"stories260K not found at {src}; skipping")
        return
    prompt = "Once upon a time"
    eval_text = (
        "Once upon a time, there was a little girl named Lily. She loved to play outside in the park "
        "with her friends. One day, she saw a big red ball under a tree."
    )
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    prompt_ids = tok.encode(prompt, add_special_tokens=True).ids
    eval_ids = tok.encode(eval_text, add_special_tokens=True).ids
    hf_tok = AutoTokenizer.from_pretrained(src)
    auto_prompt_ids = hf_tok(prompt)["input_ids"]
    auto_eval_ids = hf_tok(eval_text)["input_ids"]
    auto_match = auto_prompt_ids == prompt_ids and auto_eval_ids == eval_ids
    if not auto_match:
        print(f"  WARNING: AutoTokenizer ids differ: {auto_prompt_ids} vs {prompt_ids}")

    model = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()
    last_logits = full_logits(model, prompt_ids)[-1]
    greedy, gaps = greedy_loop(model, prompt_ids, 120)
    gen_ids = generate_ids(model, prompt_ids, 120)
    nll = mean_nll(model, eval_ids)
    ref = {
        "checkpoint": "stories260K (read from ../shared/checkpoints/stories260K; not stored here)",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "prompt": prompt,
        "prompt_ids": prompt_ids,
        "autotokenizer_ids_match": auto_match,
        "last_logits": f32_list(last_logits),
        "greedy_ids": greedy,
        "greedy_text": tok.decode(greedy, skip_special_tokens=True),
        "greedy_full_text": tok.decode(prompt_ids + greedy, skip_special_tokens=True),
        "greedy_min_top2_gap": min(gaps),
        "generate_ids": gen_ids,
        "generate_text": tok.decode(gen_ids, skip_special_tokens=True),
        "generate_equals_greedy_prefix": greedy[: len(gen_ids)] == gen_ids,
        "eval_text": eval_text,
        "eval_ids": eval_ids,
        "mean_nll": nll,
    }
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    (DATA_DIR / "stories260k_reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    print(
        f"  stories260K: greedy min gap {min(gaps):.3g}, generate {len(gen_ids)} tokens, nll {nll:.4f}\n"
        f"    {ref['greedy_full_text'][:200]!r}"
    )


def main(argv):
    only = set(argv[1:])
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, tokenizers {tokenizers.__version__}")
    tok = build_tokenizer()
    prompt_ids = tok.encode(PROMPT, add_special_tokens=True).ids
    eval_ids = tok.encode(EVAL_TEXT, add_special_tokens=True).ids
    assert prompt_ids[0] == 0 and eval_ids[0] == 0
    print(f"tokenizer vocab {tok.get_vocab_size()}, prompt {len(prompt_ids)} ids, eval {len(eval_ids)} ids")
    FIXTURES_DIR.mkdir(parents=True, exist_ok=True)
    specs = fixture_specs(tok.get_vocab_size())
    for name, (cfg_cls, model_cls, kw, opts) in specs.items():
        if only and name not in only:
            continue
        make_fixture(name, cfg_cls, model_cls, kw, opts, tok, prompt_ids, eval_ids)
    if not only or "stories260k" in only:
        make_stories_reference()


if __name__ == "__main__":
    main(sys.argv)
