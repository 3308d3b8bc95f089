"""The OpenAI / vLLM extras of `infer.py --serve` through the official `openai` client:
structured outputs, the reasoning split, chat_template_kwargs, /tokenize and /detokenize.

Structured outputs (inference/structured.py): a tiny random model writes garbage, so only
the grammar makes its answers valid. json_schema answers of 20 seeded requests at temperature 1 (batched, n > 1,
streamed) parse and validate with `jsonschema`; json_object, vLLM's choice / regex / Lark
grammar; bad schemas and grammars get a 400 with llguidance's reason, and a server without
llguidance refuses with a 400 naming it. The engine-level checks (speculative decoding gives
the plain engine's seeded answers, the grammar's end finishes a request) run in-process.
The server runs with `--reasoning-parser qwen3` and a Qwen3-style template: a regex makes
the model write a think block, which comes back as reasoning_content, streamed or not.
One server for the module."""
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


QWEN3_STYLE = (  # Qwen3's template in short: ChatML turns, an empty think block when off
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>"
    "\n\n{% endif %}{% endif %}")


def _model(folder: str) -> None:
    """test_server's tiny model with 128 positions (its byte-level tokens are short: an
    answer to SCHEMA takes up to ~60 of them) and a Qwen3-style chat template."""
    _make_model(folder)
    path = os.path.join(folder, "config.json")
    config = json.load(open(path))
    json.dump({**config, "max_position_embeddings": 128}, open(path, "w"))
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:  # transformers 5's
        f.write(QWEN3_STYLE)
    path = os.path.join(folder, "tokenizer_config.json")
    config = json.load(open(path))
    config.pop("chat_template", None)
    json.dump(config, open(path, "w"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("structured") / "tiny")
    _model(folder)
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           os.path.join(REPO, "infer.py"), "--hf", folder, "--serve", "--port", str(port),
           "--served-model-name", "tiny", "--max-batch-size", "8",
           "--reasoning-parser", "qwen3"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            start_new_session=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "serving tiny on" in line:
            break
    else:
        raise AssertionError("server did not start:\n" + "".join(lines[-40:]))
    yield folder, port
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


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
                            max_batch_size=4, max_seq_length=128, block_size=4, grammar=be,
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
    assert obj["max_model_len"] == 128 and len(obj["token_strs"]) == obj["count"]
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
