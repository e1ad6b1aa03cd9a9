#!/usr/bin/env python3
"""`tiny-decoder serve` through the official `openai` package: the checks of tests/serve
(the Rust tests, the main proof), as a real OpenAI client sees them.

    python -m venv target/venv-openai
    target/venv-openai/bin/pip install -r scripts/requirements-openai.txt
    target/venv-openai/bin/python scripts/openai_client.py [--bin target/debug/tiny-decoder]

Starts the server itself on a free loopback port with the bundled tiny-gqa (and a copy of it
with a chat template for chat), compares greedy replies with `generate --json`, and ends with
the line `N passed, N failed` (exit 1 when any failed).
"""

import argparse
import concurrent.futures as cf
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import openai
from openai import OpenAI

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny-gqa"


class Server:
    """`serve --port 0 ARGS`, killed on exit; stderr kept for the address and the log."""

    def __init__(self, binary, args, env=None):
        self.log = []
        full_env = {k: v for k, v in os.environ.items() if k != "TINY_DECODER_API_KEY"}
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [binary, "serve", "--port", "0", *args],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=full_env)
        self.url = None
        ready = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.log.append(line)
                if line.startswith("listening on "):
                    self.url = line.split()[-1]
                    ready.set()
        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(60):
            self.proc.kill()
            raise RuntimeError("serve did not start: " + "".join(self.log))

    def client(self, api_key="none"):
        # No retries: a 429 must reach the test, not be retried away.
        return OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


def generate(binary, model, prompt, n, raw=True):
    args = [binary, "generate", "-m", model, "-p", prompt, "-t", "0", "-n", str(n), "--json"]
    out = subprocess.run(args + (["--raw"] if raw else []), check=True, capture_output=True)
    return json.loads(out.stdout)


def finish_reason(stop_reason):
    return {"eos": "stop", "stop": "stop", "length": "length"}[stop_reason]


def expect_same(reply_text, finish, usage, g):
    assert reply_text == g["text"], (reply_text, g["text"])
    assert finish == finish_reason(g["stop_reason"]), (finish, g["stop_reason"])
    assert usage.prompt_tokens == len(g["prompt_token_ids"]), usage
    assert usage.completion_tokens == len(g["token_ids"]), usage


def check_completions(binary, srv):
    c = srv.client()
    assert [m.id for m in c.models.list()] == [MODEL]
    prompt = "ROMEO:\nBut soft, what light"
    g = generate(binary, MODEL, prompt, 40)
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
    expect_same(r.choices[0].text, r.choices[0].finish_reason, r.usage, g)
    stream = c.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                  stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
    expect_same(text, finish, chunks[-1].usage, g)


def check_chat(binary, srv, model_dir):
    c = srv.client()
    model_id = model_dir.name
    question = "What light through yonder window breaks?"
    g = generate(binary, str(model_dir), question, 30, raw=False)
    messages = [{"role": "user", "content": question}]
    r = c.chat.completions.create(model=model_id, messages=messages, max_tokens=30,
                                  temperature=0)
    assert r.choices[0].message.role == "assistant"
    expect_same(r.choices[0].message.content, r.choices[0].finish_reason, r.usage, g)
    stream = c.chat.completions.create(model=model_id, messages=messages, max_tokens=30,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
    expect_same(text, finish, chunks[-1].usage, g)


def check_logprobs(srv):
    """Greedy `logprobs` equal log_softmax of transformers' logits on the same weights at
    the ids it picks (ours and its greedy ids agree on tiny-gqa); chat's alternatives are
    the most likely tokens, the chosen one first."""
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(
        ROOT / "models" / MODEL, dtype=torch.float32)
    prompt = [1, 47, 8, 120, 33, 9, 64]
    ids = torch.tensor([prompt])
    want = []
    with torch.no_grad():
        for _ in range(10):
            lp = torch.log_softmax(model(ids).logits[0, -1].double(), -1)
            nxt = int(lp.argmax())
            want.append(float(lp[nxt]))
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    r = srv.client().completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                        temperature=0, logprobs=3,
                                        extra_body={"ignore_eos": True})
    got = r.choices[0].logprobs.token_logprobs
    assert len(got) == 10 and all(abs(a - b) < 1e-3 for a, b in zip(got, want)), (got, want)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(ROOT / "models" / MODEL /
                                                                  "tokenizer.json"))
    assert r.choices[0].text == tok.decode(ids[0, len(prompt):]), r.choices[0].text


def check_chat_logprobs(srv, model_dir):
    c = srv.client()
    messages = [{"role": "user", "content": "What light through yonder window breaks?"}]
    r = c.chat.completions.create(model=model_dir.name, messages=messages, max_tokens=12,
                                  temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens, content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token, t
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token, t
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
    stream = c.chat.completions.create(model=model_dir.name, messages=messages, max_tokens=12,
                                       temperature=0, logprobs=True, top_logprobs=3,
                                       stream=True)
    streamed = [t for ch in stream if ch.choices and ch.choices[0].logprobs
                for t in ch.choices[0].logprobs.content]
    # The second request reuses the first's cached prompt: equal within rounding.
    assert [t.token for t in streamed] == [t.token for t in content]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(streamed, content))


def check_prefix(srv, model_dir):
    """A conversation's next turn reuses the cache of the turn before (cached_tokens in
    usage, as OpenAI reports it) and answers as without it (`cache_prompt: false`)."""
    c = srv.client()
    messages = [{"role": "user", "content": "What light through yonder window breaks?"}]
    r = c.chat.completions.create(model=model_dir.name, messages=messages, max_tokens=10,
                                  temperature=0)
    messages += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": "And then?"}]
    cached = c.chat.completions.create(model=model_dir.name, messages=messages,
                                       max_tokens=10, temperature=0)
    fresh = c.chat.completions.create(model=model_dir.name, messages=messages, max_tokens=10,
                                      temperature=0, extra_body={"cache_prompt": False})
    assert cached.usage.prompt_tokens_details.cached_tokens > r.usage.prompt_tokens, cached.usage
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0, fresh.usage
    assert cached.choices[0].message.content == fresh.choices[0].message.content


def check_tools(binary, tmp):
    """A tools request through the openai package on a copy of tiny-gqa with Qwen2.5's
    template: the prompt the server renders (llama-server's /apply-template) is byte-identical
    to transformers' apply_chat_template(tools=...), with the assistant's call sent back as
    OpenAI returns it (arguments a JSON string) and the tool's answer."""
    import urllib.request
    import transformers
    model_dir = Path(tmp) / "tiny-qwen-tools"
    shutil.copytree(ROOT / "models" / MODEL, model_dir)
    template = (ROOT / "tests/data/chat_templates/qwen2.5.jinja").read_text()
    (model_dir / "chat_template.jinja").write_text(template)
    config = json.loads((model_dir / "config.json").read_text())
    config["max_position_embeddings"] = 1024  # only the prompt matters here
    (model_dir / "config.json").write_text(json.dumps(config))
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Get the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(model_dir / "tokenizer.json"))
    as_template_wants = json.loads(json.dumps(messages))
    as_template_wants[1] = {"role": "assistant", "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    want = tok.apply_chat_template(as_template_wants, tools=tools, chat_template=template,
                                   add_generation_prompt=True, tokenize=False)
    with Server(binary, ["-m", str(model_dir)]) as srv:
        body = json.dumps({"messages": messages, "tools": tools}).encode()
        req = urllib.request.Request(srv.url + "/apply-template", body,
                                     {"Content-Type": "application/json"})
        got = json.loads(urllib.request.urlopen(req, timeout=60).read())["prompt"]
        assert got == want, (got, want)
        r = srv.client().chat.completions.create(model=model_dir.name, messages=messages,
                                                 tools=tools, max_tokens=4, temperature=0)
        assert r.usage.prompt_tokens == len(tok(want, add_special_tokens=False)["input_ids"])
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def check_structured(srv, chat_srv, model_dir):
    """20 sampled replies under a json_schema response_format each parse and validate
    against the schema (jsonschema); json_object gives an object."""
    import jsonschema
    schema = {"type": "object",
              "properties": {"name": {"type": "string", "maxLength": 10},
                             "age": {"type": "integer", "minimum": 0, "maximum": 150},
                             "mood": {"enum": ["happy", "sad"]}},
              "required": ["name", "age", "mood"], "additionalProperties": False}
    c = srv.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                                  "strict": True}}
    for seed in range(20):
        r = c.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=100, temperature=1.0,
                                 seed=seed, extra_body={"response_format": fmt})
        jsonschema.validate(json.loads(r.choices[0].text), schema)
    r = chat_srv.client().chat.completions.create(
        model=model_dir.name, messages=[{"role": "user", "content": "Who are you?"}],
        max_tokens=100, temperature=0.7, seed=1, response_format=fmt)
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


SMOLLM2 = ROOT / "target/models/smollm2-135m-instruct"


def check_smollm2(binary):
    """The same checks on a real trained model, SmolLM2-135M-Instruct in f32 (built by
    scripts/build_smollm2.sh): greedy chat logprobs equal log_softmax of transformers' logits
    at the ids it picks, 20 sampled json_schema replies validate, and a conversation's next
    turn from the cache answers as without it."""
    import jsonschema
    import torch
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(SMOLLM2)
    model = transformers.AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    want = []
    with torch.no_grad():
        for _ in range(8):
            lp = torch.log_softmax(model(ids).logits[0, -1].double(), -1)
            nxt = int(lp.argmax())
            want.append((tok.convert_ids_to_tokens(nxt), float(lp[nxt])))
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    with Server(binary, ["-m", str(SMOLLM2), "--context", "2048"]) as srv:
        c = srv.client()
        r = c.chat.completions.create(model=SMOLLM2.name, messages=messages, max_tokens=8,
                                      temperature=0, logprobs=True, top_logprobs=2)
        got = [t.logprob for t in r.choices[0].logprobs.content]
        assert len(got) == len(want[:len(got)]) and got, (got, want)
        for g, (_, w) in zip(got, want):
            assert abs(g - w) < 2e-3, (got, want)
        schema = {"type": "object",
                  "properties": {"city": {"type": "string", "maxLength": 20},
                                 "population": {"type": "integer", "minimum": 0},
                                 "country": {"enum": ["France", "Italy", "Spain"]}},
                  "required": ["city", "population", "country"], "additionalProperties": False}
        fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
        ask = [{"role": "user", "content": "Describe Paris as JSON."}]
        for seed in range(20):
            r = c.chat.completions.create(model=SMOLLM2.name, messages=ask, max_tokens=60,
                                          temperature=1.0, seed=seed, response_format=fmt)
            jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        turn = messages + [{"role": "assistant", "content": "The capital of France is Paris."},
                           {"role": "user", "content": "And of Italy?"}]
        cached = c.chat.completions.create(model=SMOLLM2.name, messages=turn, max_tokens=12,
                                           temperature=0)
        fresh = c.chat.completions.create(model=SMOLLM2.name, messages=turn, max_tokens=12,
                                          temperature=0, extra_body={"cache_prompt": False})
        assert cached.usage.prompt_tokens_details.cached_tokens > 20, cached.usage
        assert fresh.usage.prompt_tokens_details.cached_tokens == 0, fresh.usage
        assert cached.choices[0].message.content == fresh.choices[0].message.content


def check_concurrent(binary, srv):
    lines = ["ROMEO:", "JULIET:\nO Romeo, Romeo", "First Citizen:\nBefore we proceed",
             "KING RICHARD II:", "To be, or not", "MENENIUS:\nWhat work's, my countrymen",
             "HAMLET:\nThe rest", "GLOUCESTER:\nNow is the winter", "A", "LADY CAPULET:",
             "Second Servingman:", "O, she doth teach", "BRUTUS:\nRomans, countrymen",
             "CORIOLANUS:", "Thou art", "Nurse:"]
    cases = [(p, 20 + 7 * i) for i, p in enumerate(lines)]
    want = [generate(binary, MODEL, p, n) for p, n in cases]
    c = srv.client()

    def ask(case):
        p, n = case
        return c.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0)

    with cf.ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(ask, cases))
    for r, g in zip(replies, want):
        expect_same(r.choices[0].text, r.choices[0].finish_reason, r.usage, g)


# The scheduler's slow fault (debug builds only: CI runs this against target/debug): every
# step takes at least 20 ms, so a stream outlives its client and requests sent together
# overlap on any host, however fast.
SLOW = {"TINY_DECODER_FAULT": "slow"}


def check_disconnect(binary):
    with Server(binary, [], env=SLOW) as srv:
        c = srv.client()
        stream = c.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=250,
                                      temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        next(iter(stream))
        stream.close()
        deadline = time.time() + 30
        while not any("client went away" in line for line in srv.log):
            assert time.time() < deadline, "".join(srv.log)
            time.sleep(0.05)
        r = c.completions.create(model=MODEL, prompt="JULIET:", max_tokens=5)
        assert r.choices[0].finish_reason in ("stop", "length")


def check_full_queue(binary):
    with Server(binary, ["--max-batch", "1", "--max-queue", "1"], env=SLOW) as srv:
        c = srv.client()

        def ask(_):
            try:
                c.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=50,
                                     extra_body={"ignore_eos": True})
                return 200
            except openai.RateLimitError:
                return 429
        with cf.ThreadPoolExecutor(10) as pool:
            codes = list(pool.map(ask, range(10)))
        assert 429 in codes and 200 in codes, codes


def check_errors(binary, srv):
    c = srv.client()
    bad = [dict(prompt="a", n=2), dict(prompt="a", max_tokens=300), dict(prompt="a", top_p=0)]
    for kwargs in bad:
        try:
            c.completions.create(model=MODEL, **kwargs)
            raise AssertionError(f"{kwargs} succeeded")
        except openai.BadRequestError:
            pass
    try:
        c.completions.create(model="gpt-4o", prompt="a")
        raise AssertionError("an unknown model succeeded")
    except openai.NotFoundError as e:
        assert e.code == "model_not_found", e
    try:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        raise AssertionError("chat without a template succeeded")
    except openai.BadRequestError:
        pass
    with Server(binary, [], env={"TINY_DECODER_API_KEY": "sekrit"}) as keyed:
        try:
            keyed.client("wrong").models.list()
            raise AssertionError("a wrong key was accepted")
        except openai.AuthenticationError:
            pass
        assert [m.id for m in keyed.client("sekrit").models.list()] == [MODEL]


def tiny_with_template(tmp):
    model_dir = Path(tmp) / "tiny-chat"
    shutil.copytree(ROOT / "models" / MODEL, model_dir)
    shutil.copy(ROOT / "tests/data/chat_templates/smollm2.jinja",
                model_dir / "chat_template.jinja")
    return model_dir


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default=str(ROOT / "target/debug/tiny-decoder"))
    binary = ap.parse_args().bin
    passed, failed = 0, 0
    with tempfile.TemporaryDirectory() as tmp, Server(binary, []) as srv:
        model_dir = tiny_with_template(tmp)
        with Server(binary, ["-m", str(model_dir)]) as chat_srv:
            checks = [
                ("completions", lambda: check_completions(binary, srv)),
                ("chat", lambda: check_chat(binary, chat_srv, model_dir)),
                ("logprobs", lambda: check_logprobs(srv)),
                ("chat logprobs", lambda: check_chat_logprobs(chat_srv, model_dir)),
                ("prefix reuse", lambda: check_prefix(chat_srv, model_dir)),
                ("tools", lambda: check_tools(binary, tmp)),
                ("structured output", lambda: check_structured(srv, chat_srv, model_dir)),
                ("16 concurrent", lambda: check_concurrent(binary, srv)),
                ("disconnect", lambda: check_disconnect(binary)),
                ("full queue", lambda: check_full_queue(binary)),
                ("errors", lambda: check_errors(binary, srv)),
            ]
            if SMOLLM2.is_dir():
                checks.append(("SmolLM2: logprobs, json_schema, cached turn",
                               lambda: check_smollm2(binary)))
            elif os.environ.get("TINY_DECODER_REQUIRE_SMOLLM2") == "1":
                checks.append(("SmolLM2", lambda: (_ for _ in ()).throw(
                    RuntimeError(f"{SMOLLM2} is missing: run scripts/build_smollm2.sh"))))
            else:
                print(f"SKIPPED: SmolLM2 checks ({SMOLLM2} not built)")
            for name, check in checks:
                try:
                    check()
                    passed += 1
                    print(f"ok: {name}")
                except Exception as e:  # report every check, then the count
                    failed += 1
                    print(f"FAILED: {name}: {type(e).__name__}: {e}")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
