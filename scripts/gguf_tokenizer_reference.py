#!/usr/bin/env python3
"""GGUF tokenizers and transformers' ids for them (tests/gguf_fixtures.rs).

    gguf_tokenizer_reference.py [--tokenizer ../shared/checkpoints/stories260K/tokenizer.json]

Writes tests/data/gguf/sentencepiece-512.gguf: the 512-token SentencePiece vocabulary of
stories260K (llama2.c's tok512, MIT) as llama.cpp stores one (`tokenizer.ggml.model` =
`llama`: `tokens`, `scores`, `token_type`, no merges; no tensors), with scores = -id for
ordinary pieces and 0 for the unknown, control and byte pieces, which is how SentencePiece
scores a BPE vocabulary. Then tests/data/gguf/sentencepiece-512.json: for each text,
transformers' own `AutoTokenizer.from_pretrained(dir, gguf_file=...)(text)["input_ids"]`
(it rebuilds the merges from the scores), and the ids of the original tokenizer.json for
comparison. And tests/data/gguf/bytelevel-{default,qwen2,llama-bpe}.gguf + .json: the
byte-level BPE of tests/fixtures/llama-mha-tied (384 tokens, plus four merges on digits and
on `'L` that only some split regexes let apply) as `gpt2` metadata with that
`tokenizer.ggml.pre`: GPT-2's split regex, Qwen2's (single digits) or Llama 3's (digits by
three, case-insensitive contractions). Needs gguf, transformers and torch (transformers'
GGUF reader imports it).
"""

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests/data/gguf"
NAME = "sentencepiece-512"
TEXTS = [
    "Once upon a time",
    "Lily saw a big red ball in the park. She was happy!",
    "  two leading spaces, and  two inside",
    "line one\nline two\n\n\ttab",
    "Café, naïve, 日本語, 🙂",
    "<s> literal special tokens </s> in text <unk>",
    "Hello</s>world",
    "digits 0 42 1234567",
    " ",
    "",
]


BYTE_LEVEL_TEXTS = [
    "ROMEO: But soft, what light through yonder window breaks?",
    "I'm sure they'LL say DON'T, we've 1234567 and 3.14159",
    "  spaces   before\n\n\tand after  \r\n",
    "Café naïve 日本語 🙂 — “quotes”",
    "<s>literal</s> special",
    "3123 and 1231 they'LL",
    "",
]
# Merges whose use depends on the split regex: "3123" is [3, 123] under GPT-2's, [3, 12, 3]
# under Llama 3's (312|3) and [3, 1, 2, 3] under Qwen2's; "'LL" merges only where a
# case-insensitive contraction keeps it whole.
EXTRA_MERGES = [("1", "2"), ("12", "3"), ("'", "L"), ("'L", "L")]


def write_and_compare(name: str, fill, texts: list[str], tokenizer_json: Path | None) -> None:
    """Writes tests/data/gguf/<name>.gguf (no tensors) with `fill(writer)`, then <name>.json."""
    import gguf
    import transformers
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    fill(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    theirs = AutoTokenizer.from_pretrained(OUT, gguf_file=path.name)
    original = tokenizer_json and Tokenizer.from_file(str(tokenizer_json))
    cases = []
    for text in texts:
        ids = theirs(text)["input_ids"]
        cases.append({"text": text, "ids": ids, "decoded": theirs.decode(ids, skip_special_tokens=True)})
        if original:
            cases[-1]["tokenizer_json_ids"] = original.encode(text).ids
    same = sum(c["ids"] == c.get("tokenizer_json_ids") for c in cases)
    note = "ids: transformers' GGUF tokenizer for the file"
    if original:
        note += f"; tokenizer_json_ids: the original tokenizer.json ({same} of {len(cases)} equal)"
    reference = {
        "source": "written by scripts/gguf_tokenizer_reference.py",
        "transformers": transformers.__version__,
        "note": note,
        "cases": cases,
    }
    (OUT / f"{name}.json").write_text(json.dumps(reference, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {path} ({path.stat().st_size} bytes) and {name}.json ({note})")


def byte_level(pre: str) -> None:
    tokenizer_json = ROOT / "tests/fixtures/llama-mha-tied/tokenizer.json"
    source = json.loads(tokenizer_json.read_text())
    vocab = source["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    special = {t["content"] for t in source["added_tokens"]}
    merges = [" ".join(m) for m in source["model"]["merges"]]
    for left, right in EXTRA_MERGES:
        tokens.append(left + right)
        merges.append(f"{left} {right}")

    def fill(writer) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types([3 if t in special else 1 for t in tokens])
        writer.add_token_merges(merges)
        writer.add_bos_token_id(vocab["<s>"])
        writer.add_eos_token_id(vocab["</s>"])
        writer.add_add_bos_token(True)  # as the fixture's post-processor does

    write_and_compare(f"bytelevel-{pre}", fill, BYTE_LEVEL_TEXTS, None)


def main() -> None:
    import gguf

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", type=Path, default=ROOT.parent / "shared/checkpoints/stories260K/tokenizer.json")
    args = parser.parse_args()
    for pre in ("default", "qwen2", "llama-bpe"):
        byte_level(pre)
    source = json.loads(args.tokenizer.read_text())
    vocab = source["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    special = {t["content"] for t in source["added_tokens"]}
    types, scores = [], []
    for index, token in enumerate(tokens):
        if token == "<unk>":
            kind = gguf.TokenType.UNKNOWN
        elif token in special:
            kind = gguf.TokenType.CONTROL
        elif token.startswith("<0x") and token.endswith(">") and len(token) == 6:
            kind = gguf.TokenType.BYTE
        else:
            kind = gguf.TokenType.NORMAL
        types.append(kind)
        scores.append(-float(index) if kind == gguf.TokenType.NORMAL else 0.0)

    def fill(writer) -> None:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(vocab["<s>"])
        writer.add_eos_token_id(vocab["</s>"])
        writer.add_unk_token_id(vocab["<unk>"])
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)

    write_and_compare(NAME, fill, TEXTS, args.tokenizer)


if __name__ == "__main__":
    main()
