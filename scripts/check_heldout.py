"""Generality check against transformers on checkpoints the tests have never seen.

Builds random-init checkpoints with other seeds and options than tests/fixtures (sliding
window, group-limited V2 routing with yarn in the old config layout, V3 without interleave,
Qwen3 with attention_bias, MHA without num_key_value_heads), runs the release binary's
`generate --temperature 0 --json` and `eval --json` on each, and compares with transformers.

    .venv/bin/python scripts/check_heldout.py [--bin target/release/tiny-decoder] [--out DIR]
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).parent))
from make_fixtures import build_tokenizer  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog and keeps running far away"
EVAL = "Ships passing in the night could see its warm glow from many miles away, every evening."
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=256,
            initializer_range=0.15, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
MOE = dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
           n_shared_experts=1, moe_intermediate_size=32, kv_lora_rank=32, qk_nope_head_dim=16,
           qk_rope_head_dim=8, v_head_dim=16, num_attention_heads=4, num_key_value_heads=4)
CASES = {
    "mistral-window8": (tf.MistralConfig, tf.MistralForCausalLM,
                        dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=8), None),
    "llama-mha-implicit": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(num_attention_heads=4), "drop_kv"),
    "qwen3-bias-tied": (tf.Qwen3Config, tf.Qwen3ForCausalLM,
                        dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                             attention_bias=True, tie_word_embeddings=True), None),
    "deepseek-v2-yarn-grouped-old": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM,
                                     dict(MOE, q_lora_rank=None, topk_method="group_limited_greedy",
                                          n_group=4, topk_group=2, routed_scaling_factor=1.5,
                                          rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                               original_max_position_embeddings=64,
                                                               mscale=0.707, mscale_all_dim=0.707)),
                                     "old_layout"),
    "deepseek-v3-noninterleaved": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM,
                                   dict(MOE, q_lora_rank=16, rope_interleave=False, n_group=1, topk_group=1,
                                        norm_topk_prob=False, num_nextn_predict_layers=0), None),
}


def build(name, out: Path, tok, seed: int) -> Path:
    cfg_cls, model_cls, kwargs, edit = CASES[name]
    torch.manual_seed(seed)
    cfg = cfg_cls(**{**BASE, **kwargs, "vocab_size": tok.get_vocab_size()})
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif n.endswith("bias") or "gate.weight" in n:
                p.copy_(0.3 * torch.randn_like(p))
        for n, b in model.named_buffers():
            if "e_score_correction_bias" in n:
                b.copy_(0.5 * torch.randn_like(b))
    d = out / name
    model.save_pretrained(d)
    tok.save(str(d / "tokenizer.json"))
    c = json.loads((d / "config.json").read_text())
    if edit == "drop_kv":
        c.pop("num_key_value_heads", None)
        c.pop("head_dim", None)
    if edit == "old_layout":
        rp = c.pop("rope_parameters")
        c["rope_theta"] = rp.pop("rope_theta")
        c["rope_scaling"] = {"type": rp.pop("rope_type"), **rp}
    (d / "config.json").write_text(json.dumps(c, indent=2))
    return d


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/tiny-decoder")
    ap.add_argument("--out", default=None)
    ap.add_argument("--seed", type=int, default=4242)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out or tempfile.mkdtemp(prefix="heldout-"))
    tok = build_tokenizer()
    text_file = out / "eval.txt"
    text_file.write_text(EVAL)
    failures = 0
    for i, name in enumerate(CASES):
        d = build(name, out, tok, args.seed + i)
        model = tf.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").eval()
        ids = tok.encode(PROMPT).ids
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
            eval_ids = tok.encode(EVAL).ids
            nll = model(torch.tensor([eval_ids]), labels=torch.tensor([eval_ids])).loss.item()
        if gen and gen[-1] in ([model.config.eos_token_id] if isinstance(model.config.eos_token_id, int)
                               else model.config.eos_token_id):
            gen = gen[:-1]
        run = lambda *a: json.loads(subprocess.run([args.bin, *a], check=True, capture_output=True,
                                                   text=True).stdout)
        ours = run("generate", "--model", str(d), "--prompt", PROMPT, "--temperature", "0",
                   "--max-new-tokens", "24", "--json")
        ev = run("eval", "--model", str(d), "--file", str(text_file), "--json")
        ok = ours["token_ids"] == gen and abs(ev["mean_nll"] - nll) < 2e-4
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: ids {'equal' if ours['token_ids'] == gen else 'DIFFER'} "
              f"({len(gen)}), nll ours {ev['mean_nll']:.6f} transformers {nll:.6f}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
