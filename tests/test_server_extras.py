"""The OpenAI / vLLM extras of `infer.py --serve` through the official `openai` client:
structured outputs, tool calls, the reasoning split, chat_template_kwargs, /tokenize and
/detokenize.

Structured outputs (inference/structured.py): a tiny random model writes garbage, so only
the grammar makes its answers valid. json_schema answers of 20 seeded requests at
temperature 1 (batched, n > 1, streamed) parse and validate with `jsonschema`;
json_object, vLLM's choice / regex / Lark grammar; bad schemas and grammars get a 400 with
llguidance's reason, and a server without llguidance refuses with a 400 naming it. The
engine-level checks (speculative decoding gives the plain engine's seeded answers, the
grammar's end finishes a request) run in-process.
The server runs with `--reasoning-parser qwen3 --tool-call-parser hermes
--enable-auto-tool-choice` and a Qwen3-style template: a regex makes the model write a
think block, which comes back as reasoning_content, streamed or not; a forced tool call
(required, named) is valid from a random model, its result goes back as a tool message and
the final answer follows (a second server: a Llama-3-style template, llama3_json). One
server per template."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from distributed import free_port
from launch import OWN_PROCESS_GROUP
from test_server import _make_model, _post

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                 "strict": True}}


QWEN3_STYLE = (  # Qwen3's template in short: ChatML turns, Hermes <tool_call> blocks, tool
    # results as <tool_response> in a user turn, an empty think block when thinking is off
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n"
    "{{ t | tojson }}{% endfor %}\n</tools>\nCall as <tool_call>\n{\"name\": ..., "
    "\"arguments\": ...}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m.content }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n"
    "{% if m.content %}{{ m.content }}{% endif %}{% for c in m.tool_calls or [] %}"
    "<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>"
    "\n\n{% endif %}{% endif %}")
LLAMA3_STYLE = (  # Llama 3.1's template in short: JSON calls with "parameters", ipython role
    "{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nRespond "
    "with {\"name\": function name, \"parameters\": dictionary}.\n{% for t in tools %}"
    "{{ t | tojson(indent=4) }}\n{% endfor %}<|eot_id|>{% endif %}{% for m in messages %}"
    "{% if m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for c in m.tool_calls %}{\"name\": \"{{ c.function.name }}\", \"parameters\": "
    "{{ c.function.arguments | tojson }}}{% endfor %}<|eot_id|>{% elif m.role == 'tool' %}"
    "<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% else %}"
    "<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>"
    "\n\n{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def _model(folder: str, template: str = QWEN3_STYLE) -> None:
    """test_server's tiny model with 1024 positions (its byte-level tokens are short: an
    answer to SCHEMA takes up to ~60 of them) and a chat template (Qwen3-style)."""
    _make_model(folder)
    path = os.path.join(folder, "config.json")
    config = json.load(open(path))
    json.dump({**config, "max_position_embeddings": 1024}, open(path, "w"))
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:  # transformers 5's
        f.write(template)
    path = os.path.join(folder, "tokenizer_config.json")
    config = json.load(open(path))
    config.pop("chat_template", None)
    json.dump(config, open(path, "w"))


def _serve(folder: str, *flags):
    """(process, port) of a one-process server of `folder` once it is up."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           os.path.join(REPO, "infer.py"), "--hf", folder, "--serve", "--port", str(port),
           "--served-model-name", "tiny", "--max-batch-size", "8", *flags]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            **OWN_PROCESS_GROUP)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "serving tiny on" in line:
            break
    else:
        raise AssertionError("server did not start:\n" + "".join(lines[-40:]))
    return proc, port


def _stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Qwen3-style: --reasoning-parser qwen3, hermes tool calls with auto choice."""
    folder = str(tmp_path_factory.mktemp("structured") / "tiny")
    _model(folder)
    proc, port = _serve(folder, "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
                        "--enable-auto-tool-choice")
    yield folder, port
    _stop(proc)


def _client(port):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120,
                         max_retries=0)


def test_json_schema_answers_validate(server):
    _, port = server
    client = _client(port)

    def ask(seed: int) -> list[str]:
        kw = dict(model="tiny", messages=[{"role": "user", "content": f"person {seed}"}],
                  response_format=FORMAT, temperature=1.0, seed=seed, max_tokens=100)
        if seed % 5 == 4:  # streamed: the deltas concatenate to the answer
            parts = [c.choices[0].delta.content or "" for c in
                     client.chat.completions.create(stream=True, **kw) if c.choices]
            return ["".join(parts)]
        n = 2 if seed % 5 == 3 else 1
        out = client.chat.completions.create(n=n, **kw)
        assert all(c.finish_reason == "stop" for c in out.choices), \
            [c.message.content for c in out.choices]
        return [c.message.content for c in out.choices]

    with ThreadPoolExecutor(8) as pool:  # batched together in the engine
        answers = [a for got in pool.map(ask, range(20)) for a in got]
    assert len(answers) == 24
    for text in answers:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(answers)) > 5, answers  # sampled, not one forced answer
    out = client.chat.completions.create(  # any JSON object
        model="tiny", messages=[{"role": "user", "content": "hi"}], seed=1, max_tokens=40,
        response_format={"type": "json_object"}, temperature=0.0,
        extra_body={"structured_outputs": None})
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_vllm_structured_outputs(server):
    _, port = server
    base = {"model": "tiny", "prompt": "def wrap(text", "temperature": 1.0, "max_tokens": 20}
    for seed in range(4):
        code, obj = _post(port, "/v1/completions", {
            **base, "seed": seed, "structured_outputs": {"choice": ["yes", "no way", "é?"]}},
            key=None)
        assert code == 200 and obj["choices"][0]["text"] in ("yes", "no way", "é?"), obj
        code, obj = _post(port, "/v1/completions", {
            **base, "seed": seed, "structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}},
            key=None)
        assert code == 200 and re.fullmatch(r"[0-9]{3}-[a-z]{2}", obj["choices"][0]["text"])
        code, obj = _post(port, "/v1/completions", {
            **base, "seed": seed, "structured_outputs": {
                "grammar": 'start: "(" num (" + " num)? ")"\nnum: /[1-9]/'}}, key=None)
        assert code == 200 and re.fullmatch(r"\([1-9]( \+ [1-9])?\)",
                                            obj["choices"][0]["text"]), obj


def test_bad_constraints_are_400_with_the_reason(server):
    _, port = server
    good = {"model": "tiny", "prompt": "x", "max_tokens": 3}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "objectx"}}}}, "response_format", "objectx"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format", "'schema'"),
        ({"response_format": {"type": "yaml"}}, "response_format", "'yaml'"),
        ({"response_format": "json"}, "response_format", "must be an object"),
        ({"structured_outputs": {"regex": "[a-z"}}, "structured_outputs", "unclosed"),
        ({"structured_outputs": {"grammar": "start: foo("}}, "structured_outputs", "Expected"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
         "exactly one"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
         "structured_outputs", "not both"),
    ]
    for extra, param, words in cases:
        code, obj = _post(port, "/v1/completions", {**good, **extra}, key=None)
        assert code == 400 and obj["error"]["param"] == param, (extra, obj)
        assert words in obj["error"]["message"], (extra, obj)
    code, obj = _post(port, "/v1/completions", {**good, "response_format": {"type": "text"}},
                      key=None)
    assert code == 200, obj


def test_without_llguidance_structured_requests_are_refused(monkeypatch):
    """No llguidance: parsing names the package (400), the engine's backend says why."""
    from inference import protocol, structured

    monkeypatch.setitem(sys.modules, "llguidance", None)  # import fails
    with pytest.raises(protocol.APIError) as e:
        protocol.structured_grammar({"response_format": {"type": "json_object"}})
    assert e.value.status == 400 and "'llguidance'" in e.value.message
    assert protocol.structured_grammar({"response_format": {"type": "text"}}) is None
    assert "'llguidance'" in structured.backend(object(), 10).unavailable


def test_engine_grammar_with_speculative_decoding(tmp_path):
    """In-process engines: n-gram speculative decoding gives the plain engine's seeded answers
    under the grammar (drafts the grammar refuses are rejected), every answer is valid and
    ends when the grammar does, and a grammar request on an engine without a backend is
    refused by `check` with the reason."""
    import torch.distributed as dist

    import parallel_state as ps
    from inference.engine import Engine, Request
    from inference.loading import load
    from inference.sampling import SamplingParams
    from inference.spec_decode import SpecDecoder, SpeculativeConfig
    from inference.structured import GrammarError, backend, grammar_of

    if dist.is_initialized() or "RANK" in os.environ:
        pytest.skip("this process already runs a world")
    folder = str(tmp_path / "tiny")
    _model(folder)
    ps.initialize_distributed("cpu")
    ps.initialize_model_parallel(1, 1, device="cpu")
    try:
        model, tok, _ = load(hf=folder)
        grammar = grammar_of("json", SCHEMA)
        be = backend(tok, model.config.vocab_size)
        prompt = tok.encode("def wrap(text")
        texts = {}
        for name, spec in (("plain", None), ("ngram", SpeculativeConfig(
                num_speculative_tokens=3))):
            engine = Engine(model, eos_token_ids=[tok.eod], decode=tok.decode,
                            max_batch_size=4, max_seq_length=1024, block_size=4, grammar=be,
                            speculative=SpecDecoder(spec) if spec else None)
            reqs = [Request(str(i), prompt, SamplingParams(
                max_new_tokens=100, temperature=1.0 if i else 0.0, seed=i, grammar=grammar))
                for i in range(6)]
            engine.generate(reqs)
            texts[name] = [r.text for r in reqs]
            for r in reqs:
                assert r.finish_reason == "stop", (r.text, r.output)
                jsonschema.validate(json.loads(r.text), SCHEMA)
            if spec:
                assert engine.spec.stats.num_draft_tokens > 0
        assert texts["ngram"] == texts["plain"]
        bare = Engine(model, max_batch_size=1, max_seq_length=64, block_size=4)
        with pytest.raises(GrammarError, match="no tokenizer"):
            bare.check(prompt, SamplingParams(grammar=grammar))
    finally:
        ps.destroy_model_parallel()


def test_reasoning_split_streamed_and_not(server):
    _, port = server
    client = _client(port)
    think = r"<think>[a-z]{1,5}( [a-z]{1,5}){0,2}</think>\n\n[A-Z][a-z]{1,6}\."
    kw = dict(model="tiny", messages=[{"role": "user", "content": "2+2?"}], max_tokens=60,
              temperature=1.0, extra_body={"structured_outputs": {"regex": think}})
    for seed in range(3):
        out = client.chat.completions.create(seed=seed, **kw).choices[0]
        reasoning = out.message.model_extra["reasoning_content"]
        assert out.finish_reason == "stop", out
        assert re.fullmatch(r"[a-z]{1,5}( [a-z]{1,5}){0,2}", reasoning), out.message
        assert re.fullmatch(r"\n\n[A-Z][a-z]{1,6}\.", out.message.content), out.message
        chunks = [c.choices[0].delta for c in client.chat.completions.create(
            seed=seed, stream=True, **kw) if c.choices]
        streamed = ["".join(d.model_extra.get("reasoning_content") or "" for d in chunks),
                    "".join(d.content or "" for d in chunks)]
        assert streamed == [reasoning, out.message.content]
        assert sum(bool(d.model_extra.get("reasoning_content")) for d in chunks) > 1  # deltas
    # no think block: all content, reasoning_content null
    out = client.chat.completions.create(**{**kw, "extra_body": {
        "structured_outputs": {"regex": "[A-Z][a-z]{1,6}"}}}).choices[0]
    assert out.message.model_extra["reasoning_content"] is None and out.message.content


def test_chat_template_kwargs_and_tokenize_round_trip(server):
    folder, port = server
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "hi"}]
    for kwargs in ({}, {"enable_thinking": False}):  # the template sees the variable
        code, obj = _post(port, "/tokenize", {"model": "tiny", "messages": messages,
                                              "chat_template_kwargs": kwargs}, key=None)
        want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=True, **kwargs)["input_ids"]
        assert code == 200 and obj["tokens"] == list(want), (obj, kwargs)
        assert ("<think>" in tok.decode(want)) == bool(kwargs)
        code, chat = _post(port, "/v1/chat/completions", {
            "model": "tiny", "messages": messages, "max_tokens": 1,
            "chat_template_kwargs": kwargs}, key=None)
        assert code == 200 and chat["usage"]["prompt_tokens"] == obj["count"], chat
    text = "héllo wörld, 日本語 ✓ 🎉 naïve — ок"
    code, obj = _post(port, "/tokenize", {"prompt": text, "return_token_strs": True},
                      key=None)
    assert code == 200 and obj["count"] == len(obj["tokens"]) > len(text) // 4, obj
    assert obj["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
    assert obj["max_model_len"] == 1024 and len(obj["token_strs"]) == obj["count"]
    code, back = _post(port, "/detokenize", {"model": "tiny", "tokens": obj["tokens"]},
                       key=None)
    assert code == 200 and back == {"prompt": text}, back
    for path, body, param in (("/detokenize", {"tokens": [10**6]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens"),
                              ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"messages": messages,
                                             "chat_template_kwargs": [1]},
                               "chat_template_kwargs")):
        code, obj = _post(port, path, body, key=None)
        assert code == 400 and obj["error"]["param"] == param, (body, obj)
    code, obj = _post(port, "/tokenize", {"model": "other", "prompt": "x"}, key=None)
    assert code == 404, obj


def _round_trip(folder: str, port: int, marker: str):
    """call (forced: valid from a random model) -> tool result -> final answer, with the
    openai client; the prompts the template built hold the call and its result."""
    client = _client(port)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    kw = dict(model="tiny", tools=[WEATHER, TIME], temperature=1.0, max_tokens=150)
    for seed in range(3):
        out = client.chat.completions.create(messages=messages, tool_choice="required",
                                             seed=seed, **kw).choices[0]
        assert out.finish_reason == "tool_calls", out.message.content
        (call,) = out.message.tool_calls
        args = json.loads(call.function.arguments)
        fn = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]
        jsonschema.validate(args, fn["parameters"])
        assert call.id and call.type == "function"
    named = client.chat.completions.create(  # a named function, streamed and not
        messages=messages, seed=7, tool_choice={"type": "function", "function": {
            "name": "get_weather"}}, **kw).choices[0]
    (call,) = named.message.tool_calls
    assert call.function.name == "get_weather" and named.message.content is None
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    deltas = [c.choices[0] for c in client.chat.completions.create(
        messages=messages, seed=7, stream=True, tool_choice={"type": "function", "function": {
            "name": "get_weather"}}, **kw) if c.choices]
    streamed = [t for d in deltas for t in d.delta.tool_calls or []]
    assert [(t.index, t.function.name, t.function.arguments) for t in streamed] == \
        [(0, "get_weather", call.function.arguments)]
    assert deltas[-1].finish_reason == "tool_calls"
    assert not "".join(d.delta.content or "" for d in deltas)
    # the tool's result goes back; the final answer is text
    messages += [named.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "22 degrees"}]
    final = client.chat.completions.create(messages=messages, tool_choice="none", seed=1,
                                           **kw).choices[0]
    assert final.finish_reason in ("stop", "length") and not final.message.tool_calls
    assert isinstance(final.message.content, str)
    code, obj = _post(port, "/tokenize", {"messages": messages, "tools": [WEATHER]}, key=None)
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(folder).decode(obj["tokens"])
    assert code == 200 and marker in text and "22 degrees" in text, text
    assert json.loads(call.function.arguments)["city"] in text and '"get_weather"' in text
    return client


def test_tool_call_round_trip_hermes(server):
    folder, port = server
    client = _round_trip(folder, port, "<tool_response>\n22 degrees")
    # auto: whatever the model writes is parsed (a regex makes it write a call after text)
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "time?"}], tools=[WEATHER, TIME],
        max_tokens=150, extra_body={"structured_outputs": {"regex": "Sure[.] " + re.escape(
            call).replace("\\\n", "\n")}}).choices[0]
    assert out.finish_reason == "tool_calls", out
    assert out.message.content == "Sure." and out.message.tool_calls[0].function.name == \
        "get_time" and json.loads(out.message.tool_calls[0].function.arguments) == {
            "zone": "UTC"}
    good = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for extra, param in (({"tools": [{"type": "function"}]}, "tools"),
                         ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {
                             "name": "nope"}}}, "tool_choice"),
                         ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
                         ({"tool_choice": "required"}, "tool_choice"),
                         ({"tools": [WEATHER], "tool_choice": "required",
                           "response_format": {"type": "json_object"}}, "tool_choice")):
        code, obj = _post(port, "/v1/chat/completions", {**good, **extra}, key=None)
        assert code == 400 and obj["error"]["param"] == param, (extra, obj)


def test_tool_call_round_trip_llama3(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("llama3") / "tiny")
    _model(folder, LLAMA3_STYLE)
    proc, port = _serve(folder, "--tool-call-parser", "llama3_json")
    try:
        _round_trip(folder, port, "ipython<|end_header_id|>\n\n22 degrees")
        # no --enable-auto-tool-choice: 'auto' (OpenAI's default with tools) is refused
        code, obj = _post(port, "/v1/chat/completions", {
            "model": "tiny", "messages": [{"role": "user", "content": "x"}],
            "tools": [WEATHER]}, key=None)
        assert code == 400 and "--enable-auto-tool-choice" in obj["error"]["message"], obj
    finally:
        _stop(proc)


def test_echo(server):
    _, port = server
    client = _client(port)
    prompt = "héllo 日本 "
    out = client.completions.create(model="tiny", prompt=[prompt, "def x"], echo=True, n=2,
                                    max_tokens=5, temperature=0)
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=5,
                                      temperature=0)
    assert [c.text[:len(prompt)] for c in out.choices[:2]] == [prompt, prompt]
    assert out.choices[0].text == prompt + plain.choices[0].text
    assert out.choices[2].text.startswith("def x")
    parts = {}
    for c in client.completions.create(model="tiny", prompt=prompt, echo=True, max_tokens=5,
                                       temperature=0, stream=True):
        for ch in c.choices:
            parts[ch.index] = parts.get(ch.index, "") + ch.text
    assert parts == {0: out.choices[0].text}
    code, obj = _post(port, "/tokenize", {"prompt": prompt}, key=None)
    ids = obj["tokens"]
    by_ids = client.completions.create(model="tiny", prompt=ids, echo=True, max_tokens=5,
                                       temperature=0)
    assert by_ids.choices[0].text == out.choices[0].text
