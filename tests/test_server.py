"""`infer.py --serve` under torchrun (tp=2 x dp=2, `--api-key`) answering the official `openai`
client on loopback: both endpoints, streaming and not, n and usage, 32 concurrent requests
equal to their single answers and spread over both replicas, logprobs, vLLM's prompt_logprobs
and echo with logprobs against transformers, the bad inputs of the API (each followed by a
good request), a missing or wrong API key (401), a client that drops a stream,
and a clean stop on Ctrl-C. One server for the whole module."""
from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from distributed import free_port
from launch import OWN_PROCESS_GROUP

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the [test] extra installs these; a missing one is a broken install, not a reason to skip
import fastapi  # noqa: E402,F401
import openai  # noqa: E402,F401
import uvicorn  # noqa: E402,F401

API_KEY = "sk-test-key"
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n"
                 "{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def _make_model(folder: str) -> None:
    """Tiny random Llama (GQA, 2 KV heads) with a small trained BPE tokenizer + chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=400, hidden_size=64, intermediate_size=96,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=64,
                                 initializer_range=0.2, tie_word_embeddings=False,
                                 bos_token_id=1, eos_token_id=2)).save_pretrained(folder)
    text = open(os.path.join(os.path.dirname(os.__file__), "textwrap.py")).read()
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = __import__("tokenizers").decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>", chat_template=CHAT_TEMPLATE).save_pretrained(folder)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("served") / "tiny")
    _make_model(folder)
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           os.path.join(REPO, "infer.py"), "--hf", folder, "--tp", "2", "--dp", "2", "--serve",
           "--port", str(port), "--served-model-name", "tiny", "--max-batch-size", "8",
           "--api-key", API_KEY]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            **OWN_PROCESS_GROUP)
    lines = []
    for line in proc.stdout:  # blocks until the server says it is up (or dies)
        lines.append(line)
        if "serving tiny on" in line:
            break
    else:
        raise AssertionError("server did not start:\n" + "".join(lines[-40:]))
    yield folder, port, proc, lines
    if proc.poll() is None:  # a test failed before the Ctrl-C test: stop it the clean way
        proc.send_signal(signal.SIGTERM)  # torchrun forwards it to the workers
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _client(port):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, timeout=120,
                         max_retries=0)


def _post(port, path, body, raw=None, key=API_KEY, method="POST"):
    """(status, JSON body) of a raw request (the standard library, so bad bodies go through);
    `key` None sends no Authorization header."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    conn.request(method, path, body=None if method == "GET" else
                 raw if raw is not None else json.dumps(body), headers=headers)
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out


def test_openai_client_both_endpoints(server):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, port, _, _ = server
    client = _client(port)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    tok = AutoTokenizer.from_pretrained(folder)
    prompt = "def wrap(text, width"
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False,
                      eos_token_id=tok.eos_token_id, pad_token_id=0)[0, len(ids):]
    assert out.choices[0].text == tok.decode(ref, skip_special_tokens=True)
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == len(ref)
    streamed = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=10,
                                              temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text
    assert streamed[-1].choices[0].finish_reason == out.choices[0].finish_reason

    messages = [{"role": "user", "content": "Wrap this text."}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                          temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages,
                                                 max_tokens=12, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        chat.choices[0].message.content
    assert chat.choices[0].finish_reason in ("stop", "length")
    # n with a seed: n choices, reproducible
    a = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, n=2, seed=7,
                                  temperature=1.0)
    b = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, n=2, seed=7,
                                  temperature=1.0)
    assert len(a.choices) == 2 and [c.text for c in a.choices] == [c.text for c in b.choices]
    # stop strings cut the text
    word = out.choices[0].text.strip()[:3]
    if word:
        cut = client.completions.create(model="tiny", prompt=prompt, max_tokens=10,
                                        temperature=0, stop=[word])
        assert word not in cut.choices[0].text and cut.choices[0].finish_reason == "stop"


def test_concurrent_requests_equal_single_answers(server):
    _, port, _, _ = server
    client = _client(port)
    prompts = [f"line {i} of the" for i in range(8)]

    def ask(p):
        return client.completions.create(model="tiny", prompt=p, max_tokens=8 + len(p) % 3,
                                         temperature=0).choices[0].text
    single = {p: ask(p) for p in prompts}
    _, before = _post(port, "/health", None, method="GET")
    with ThreadPoolExecutor(32) as pool:
        many = list(pool.map(ask, prompts * 4))
    assert many == [single[p] for p in prompts * 4]
    # dp=2: the least-work router gave both replicas a share of the 32 requests
    _, after = _post(port, "/health", None, method="GET")
    got = [a["served"] - b["served"] for a, b in zip(after["replicas"], before["replicas"])]
    assert len(got) == 2 and sum(got) == 32 and min(got) >= 8, got
    assert [r["queued_tokens"] for r in after["replicas"]] == [0, 0], after


def test_api_key(server):
    import openai

    _, port, _, _ = server
    good = {"model": "tiny", "prompt": "hello", "max_tokens": 2, "temperature": 0}
    for path, body, method in (("/v1/completions", good, "POST"),
                               ("/v1/chat/completions", {"model": "tiny", "messages": [
                                   {"role": "user", "content": "hi"}]}, "POST"),
                               ("/v1/models", None, "GET")):
        for key in (None, "sk-wrong"):
            code, obj = _post(port, path, body, key=key, method=method)
            assert code == 401, (path, key, code, obj)
            assert obj["error"]["type"] == "authentication_error", obj
            assert obj["error"]["code"] == "invalid_api_key" and obj["error"]["message"], obj
    wrong = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-wrong",
                          max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(**good)
    assert _post(port, "/v1/completions", good)[0] == 200  # the right key still works


def test_bad_inputs_then_good_request(server):
    import http.client

    _, port, _, _ = server
    good = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [
        ("/v1/completions", None, b"{not json", 400),
        ("/v1/completions", {**good, "model": "gpt-9"}, None, 404),
        ("/v1/completions", {**good, "prompt": ""}, None, 400),
        ("/v1/completions", {**good, "prompt": "word " * 200}, None, 400),
        ("/v1/completions", {**good, "max_tokens": -1}, None, 400),
        ("/v1/completions", {**good, "max_tokens": 10**9}, None, 400),
        ("/v1/completions", {**good, "temperature": -1}, None, 400),
        ("/v1/completions", {**good, "top_p": 2}, None, 400),
        ("/v1/completions", {**good, "n": 0}, None, 400),
        ("/v1/chat/completions", {"model": "tiny", "messages": []}, None, 400),
        ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, None, 400),
        ("/v1/chat/completions", {"model": "tiny", "messages": [
            {"role": "wizard", "content": "hi"}]}, None, 400),
        ("/v1/completions", {**good, "model": 5}, None, 400),
        ("/v1/completions", {**good, "seed": 2**70}, None, 400),  # torch's generator: 64 bits
        ("/v1/completions", {**good, "seed": 2**63 - 1, "n": 2}, None, 400),  # seed + 1
        ("/v1/chat/completions", {**chat, "echo": True}, None, 400),  # a completions field
        # prompt_logprobs: vLLM's range (-1, the whole vocabulary, is above the limit of 20)
        # and not streamed
        ("/v1/completions", {**good, "prompt_logprobs": -1}, None, 400),
        ("/v1/completions", {**good, "prompt_logprobs": 21}, None, 400),
        ("/v1/completions", {**good, "prompt_logprobs": True}, None, 400),
        ("/v1/completions", {**good, "prompt_logprobs": 1, "stream": True}, None, 400),
        # logprobs: OpenAI's types and ranges per endpoint (vLLM's max, 20)
        ("/v1/completions", {**good, "logprobs": 21}, None, 400),
        ("/v1/completions", {**good, "logprobs": -1}, None, 400),
        ("/v1/completions", {**good, "logprobs": True}, None, 400),
        ("/v1/completions", {**good, "logprobs": "2"}, None, 400),
        ("/v1/completions", {**good, "top_logprobs": 2}, None, 400),  # a chat field
        ("/v1/chat/completions", {**chat, "top_logprobs": 2}, None, 400),  # needs logprobs
        ("/v1/chat/completions", {**chat, "logprobs": False, "top_logprobs": 0}, None, 400),
        ("/v1/chat/completions", {**chat, "logprobs": 3}, None, 400),
        ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}, None, 400),
        ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 1.5}, None, 400),
        ("/v1/completions", {**good, "response_format": {"type": "yaml"}}, None, 400),
    ]
    for path, body, raw, status in cases:
        code, obj = _post(port, path, body, raw)
        assert code == status, (body or raw, code, obj)
        assert set(obj["error"]) >= {"message", "type", "param", "code"}, obj
        code, obj = _post(port, "/v1/completions", good)
        assert code == 200 and obj["choices"][0]["text"] is not None, obj
    # the "off" values of unimplemented fields, as SDKs send them, are fine
    code, obj = _post(port, "/v1/completions", {**good, "logprobs": None, "echo": False,
                                                "best_of": 1, "response_format": {"type": "text"}})
    assert code == 200, obj
    # the router's own errors are OpenAI error objects too
    code, obj = _post(port, "/v1/complete", good)
    assert code == 404 and "POST /v1/completions" in obj["error"]["message"], (code, obj)
    code, obj = _post(port, "/v1/completions", None, method="GET")
    assert code == 405 and "use POST" in obj["error"]["message"], (code, obj)
    assert obj["error"]["type"] == "invalid_request_error", obj
    # a client that goes away mid-stream: the server drops it and serves the next request
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {**good, "max_tokens": 40, "stream": True}), headers={
            "content-type": "application/json", "authorization": f"Bearer {API_KEY}"})
    r = conn.getresponse()
    assert r.status == 200 and r.readline().startswith(b"data: ")
    conn.close()
    code, obj = _post(port, "/v1/completions", good)
    assert code == 200


def _reference_logprobs(folder, prompt_ids, output_ids):
    """(log_softmax of HF's float32 logits at each output position [n, V], the float32 `k`
    and scale of tests/tolerances.py for them)."""
    from transformers import AutoModelForCausalLM

    from models.hf import config_from_hf
    from tolerances import forward_chain_terms

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids + output_ids])).logits[0].float()
    logits = logits[len(prompt_ids) - 1:len(prompt_ids) - 1 + len(output_ids)]
    cfg = config_from_hf(json.load(open(os.path.join(folder, "config.json"))))
    k = forward_chain_terms(cfg, len(prompt_ids) + len(output_ids))
    return torch.log_softmax(logits, dim=-1), k, float(logits.abs().max())


def test_logprobs_both_endpoints(server):
    """logprobs through the openai client at tp=2 x dp=2: /v1/completions (`logprobs: N`) and
    /v1/chat/completions (`logprobs: true`, `top_logprobs: N`), greedy and seeded sampling,
    streamed and not; every value equals log_softmax of HF's logits for the same ids, the
    shapes are the ones the SDK parses, the bytes concatenate to the text."""
    from inference.logprobs import token_text
    from models.tokenizer import Tokenizer
    from tolerances import assert_fp32_close

    folder, port, _, _ = server
    client = _client(port)
    tok = Tokenizer(folder)
    by_bytes = {tok.token_bytes(i): i for i in range(tok.vocab_size)}
    assert len(by_bytes) == tok.vocab_size  # every token has its own bytes: ids from bytes
    worst = 0.0

    def check(prompt_ids, ids, logprobs, tops, where, n=0):
        """`tops[j]`: [(id, logprob)] of position j as the server listed them, the first `n`
        being the n most likely (ties may swap ids: each id's own value is checked)."""
        nonlocal worst
        ref, k, scale = _reference_logprobs(folder, prompt_ids, ids)
        got = torch.tensor(logprobs + [lp for top in tops for _, lp in top])
        want = torch.cat([ref.gather(1, torch.tensor(ids)[:, None])[:, 0],
                          torch.tensor([float(ref[j, i]) for j, top in enumerate(tops)
                                        for i, _ in top])])
        assert_fp32_close(got, want, k, where, scale=scale)
        worst = max(worst, float((got - want).abs().max()))
        if n:
            assert all(len(top) >= n for top in tops), where
            assert_fp32_close(torch.tensor([[lp for _, lp in top[:n]] for top in tops]),
                              ref.topk(n).values, k, where + " (top n)", scale=scale)

    # completions, greedy, logprobs 3: top 3 and the sampled token (here one of them)
    prompt = "def wrap(text, width"
    prompt_ids = tok.encode(prompt)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                    logprobs=3)
    lp = out.choices[0].logprobs
    ids = [by_bytes[_token_bytes(t)] for t in lp.tokens]
    assert len(ids) == out.usage.completion_tokens
    assert lp.tokens == [token_text(tok.token_bytes(i), i) for i in ids]
    tops = [[(by_bytes[_token_bytes(t)], v) for t, v in d.items()] for d in lp.top_logprobs]
    assert all(len(d) == 3 and ids[j] in dict(d) for j, d in enumerate(tops))
    assert all(max(d.values()) == d[t] for d, t in zip(lp.top_logprobs, lp.tokens))  # greedy
    check(prompt_ids, ids, lp.token_logprobs, tops, "completions greedy", n=3)
    text = out.choices[0].text  # each token's text sits at its offset (EOS is not in the
    # text; a token with part of a character is `bytes:...`)
    assert all(text[o:o + len(t)] == t for o, t, i in zip(lp.text_offset, lp.tokens, ids)
               if i != tok.eod and not t.startswith("bytes:")) and lp.text_offset[0] == 0
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                            temperature=0, logprobs=3, stream=True))
    parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [o for p in parts for o in p.text_offset] == lp.text_offset  # runs on over chunks
    check(prompt_ids, ids, [v for p in parts for v in p.token_logprobs],
          [[(by_bytes[_token_bytes(t)], v) for t, v in d.items()] for p in parts
           for d in p.top_logprobs], "completions greedy streamed", n=3)
    # n = 2 sampled: each choice its own logprobs, one entry per generated token
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, n=2, seed=3,
                                    temperature=1.0, logprobs=0)
    assert sum(len(c.logprobs.tokens) for c in out.choices) == out.usage.completion_tokens
    assert all(list(d) == [t] for c in out.choices  # logprobs 0: just the sampled token
               for d, t in zip(c.logprobs.top_logprobs, c.logprobs.tokens))
    for c in out.choices:
        check(prompt_ids, [by_bytes[_token_bytes(t)] for t in c.logprobs.tokens],
              c.logprobs.token_logprobs, [[]] * len(c.logprobs.tokens), "completions n=2")

    # chat, seeded sampling, top_logprobs 4
    messages = [{"role": "user", "content": "Wrap this text."}]
    prompt_ids = tok.apply_chat_template(messages)
    ask = dict(model="tiny", messages=messages, max_tokens=8, temperature=1.0, seed=5,
               logprobs=True, top_logprobs=4)
    chat = client.chat.completions.create(**ask)
    content = chat.choices[0].logprobs.content
    ids = [by_bytes[bytes(c.bytes)] for c in content]
    assert len(ids) == chat.usage.completion_tokens
    assert all(c.token == token_text(bytes(c.bytes), i) for c, i in zip(content, ids))
    text = b"".join(bytes(c.bytes) for c, i in zip(content, ids) if i != tok.eod)
    # a random model emits stray bytes: shown as U+FFFD as the tokenizer's decode shows them
    assert text.decode(errors="replace") == chat.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 4 and [t.logprob for t in c.top_logprobs] == sorted(
            (t.logprob for t in c.top_logprobs), reverse=True)
        assert all(t.token == token_text(bytes(t.bytes), 0) for t in c.top_logprobs)
    tops = [[(by_bytes[bytes(t.bytes)], t.logprob) for t in c.top_logprobs] for c in content]
    check(prompt_ids, ids, [c.logprob for c in content], tops, "chat sampled", n=4)
    chunks = list(client.chat.completions.create(**ask, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [by_bytes[bytes(e.bytes)] for e in streamed] == ids  # the same seeded draws
    assert chunks[0].choices[0].logprobs is None  # the role chunk
    check(prompt_ids, ids, [e.logprob for e in streamed],
          [[(by_bytes[bytes(t.bytes)], t.logprob) for t in e.top_logprobs] for e in streamed],
          "chat sampled streamed", n=4)
    # logprobs without top_logprobs: no alternatives; without logprobs: null
    plain = client.chat.completions.create(**{**ask, "top_logprobs": None})
    assert all(c.top_logprobs == [] for c in plain.choices[0].logprobs.content)
    assert client.chat.completions.create(**{**ask, "logprobs": None, "top_logprobs": None}
                                          ).choices[0].logprobs is None
    code, obj = _post(port, "/v1/chat/completions", {**ask, "logprobs": False})
    assert code == 400 and obj["error"]["param"] == "top_logprobs", obj
    assert "'logprobs': true" in obj["error"]["message"], obj
    print(f"max |logprob - HF log_softmax| over the server's answers: {worst:.3g}")


def test_prompt_logprobs_and_echo_with_logprobs(server):
    """vLLM's prompt_logprobs through the openai client at tp=2 x dp=2 (completions: per
    choice; chat: top level), and echo with logprobs (OpenAI's: the prompt's tokens lead, the
    first one null), streamed and not: every value equals log_softmax of HF's logits of the
    prompt, the ranks count the more likely ids."""
    from transformers import AutoModelForCausalLM

    from inference.logprobs import token_text
    from models.hf import config_from_hf
    from models.tokenizer import Tokenizer
    from tolerances import assert_fp32_close, forward_chain_terms

    folder, port, _, _ = server
    client = _client(port)
    tok = Tokenizer(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    cfg = config_from_hf(json.load(open(os.path.join(folder, "config.json"))))

    def check(prompt_ids, entries, n, where):
        """`entries`: the server's prompt_logprobs (None, then {id: {logprob, rank,
        decoded_token}} holding the token and the n most likely)."""
        with torch.no_grad():
            logits = hf(torch.tensor([prompt_ids])).logits[0, :-1].float()
        ref, k = torch.log_softmax(logits, -1), forward_chain_terms(cfg, len(prompt_ids))
        assert entries[0] is None and len(entries) == len(prompt_ids), where
        got, want = [], []
        for j, (d, t) in enumerate(zip(entries[1:], prompt_ids[1:])):
            assert str(t) in d and n <= len(d) <= n + 1, (where, d)
            for i, v in d.items():
                got.append(v["logprob"])
                want.append(float(ref[j, int(i)]))
                assert v["decoded_token"] == token_text(tok.token_bytes(int(i)), int(i))
            mine = d[str(t)]
            more = int((ref[j] > ref[j, t] + 1e-4).sum()), int((ref[j] > ref[j, t] - 1e-4).sum())
            assert more[0] + 1 <= mine["rank"] <= more[1] + 1, (where, j, mine, more)
        assert_fp32_close(torch.tensor(got), torch.tensor(want), k, where,
                          scale=float(logits.abs().max()))

    prompt = "def wrap(text, width): héllo 日本"
    prompt_ids = tok.encode(prompt)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                    n=2, extra_body={"prompt_logprobs": 2})
    for c in out.choices:
        check(prompt_ids, c.prompt_logprobs, 2, "completions prompt_logprobs")
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    assert out.choices[0].text == plain.choices[0].text  # scoring leaves the answer alone
    assert not hasattr(plain.choices[0], "prompt_logprobs") or \
        plain.choices[0].prompt_logprobs is None
    # echo + logprobs: the prompt's tokens (first null) then the answer's, offsets run on
    echo = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                     echo=True, logprobs=1)
    lp = echo.choices[0].logprobs
    assert echo.choices[0].text == prompt + plain.choices[0].text
    assert len(lp.tokens) == len(prompt_ids) + echo.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[:len(prompt_ids)] == [token_text(tok.token_bytes(i), i)
                                           for i in prompt_ids]
    scored = out.choices[0].prompt_logprobs
    assert_fp32_close(torch.tensor(lp.token_logprobs[1:len(prompt_ids)]), torch.tensor(
        [d[str(t)]["logprob"] for d, t in zip(scored[1:], prompt_ids[1:])]), 1,
        "echo vs prompt_logprobs", scale=1.0)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=4,
                                            temperature=0, echo=True, logprobs=1, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echo.choices[0].text
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [v for p in parts for v in p.token_logprobs] == lp.token_logprobs
    # chat: one top-level prompt_logprobs for the templated prompt
    messages = [{"role": "user", "content": "Wrap this text."}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3,
                                          temperature=0, extra_body={"prompt_logprobs": 0})
    entries = chat.model_extra["prompt_logprobs"]
    check(tok.apply_chat_template(messages), entries, 0, "chat prompt_logprobs")


def test_logprobs_token_strings_bytes_and_offsets(tmp_path):
    """The token strings, bytes and text offsets of inference/logprobs.py over a Llama-2-style
    byte-fallback tokenizer, the project's SentencePiece model and byte-level BPE, on text
    with emoji, CJK and accents: the tokens' bytes concatenate to the text, a token holding
    part of a character is `bytes:\\xNN..` with its own bytes, offsets point at each token's
    text and run on across chunks; -inf / NaN are written -9999.0 (valid JSON)."""
    from test_detokenize import TEXT, llama2_style_tokenizer

    from inference.logprobs import LogprobsFormat, token_text
    from models.tokenizer import Tokenizer, train_sentencepiece

    llama = str(tmp_path / "llama2")
    llama2_style_tokenizer().save_pretrained(llama)
    _make_model(str(tmp_path / "bpe"))
    corpus = os.path.join(os.path.dirname(os.__file__), "textwrap.py")
    tokenizers = {"llama2-style": Tokenizer(llama), "byte-level": Tokenizer(str(
        tmp_path / "bpe")), "sentencepiece": Tokenizer(train_sentencepiece(
            [corpus], str(tmp_path / "sp"), 400))}
    for name, tok in tokenizers.items():
        ids = tok.encode(TEXT)
        raw = [tok.token_bytes(i) for i in ids]
        # Llama-2's decode drops the first token's leading space; its bytes keep it (vLLM too)
        lead = b" " if name == "llama2-style" else b""
        assert b"".join(raw) == lead + TEXT.encode(), name
        split = [r for r in raw if _is_partial(r)]
        assert split, f"{name}: no token holds part of a character; the test needs one"
        for i, r in zip(ids, raw):
            text = token_text(r, i)
            assert text.startswith("bytes:\\x") == _is_partial(r), (name, text)
            assert _token_bytes(text) == r, (name, text)
        assert tok.token_bytes(tok.eod) == b"</s>", name  # a special token: its text
        assert token_text(tok.token_bytes(tok.vocab_size), tok.vocab_size) == \
            f"token_id:{tok.vocab_size}"  # a padded vocabulary's id
        entries = [(i, -0.5, [(i, -0.5), (ids[0], -1.0)]) for i in ids]
        whole = LogprobsFormat(1, False, tok.token_bytes).format(0, entries)
        assert whole["tokens"] == [token_text(r, i) for i, r in zip(ids, raw)], name
        assert all(len(d) <= 2 and d[t] == -0.5 for d, t in
                   zip(whole["top_logprobs"], whole["tokens"])), name  # top 1 + the sampled
        text = lead.decode() + TEXT
        for o, t in zip(whole["text_offset"], whole["tokens"]):
            assert text[o:o + len(t)] == t or t.startswith("bytes:"), (name, o, t)
        half = len(entries) // 2  # a stream: offsets run on in the second chunk
        fmt = LogprobsFormat(1, False, tok.token_bytes)
        assert fmt.format(3, entries[:half])["text_offset"] + \
            fmt.format(3, entries[half:])["text_offset"] == whole["text_offset"], name
        chat = LogprobsFormat(1, True, tok.token_bytes).format(0, entries)["content"]
        assert b"".join(bytes(e["bytes"]) for e in chat) == lead + TEXT.encode(), name
        assert all(len(e["top_logprobs"]) == 1 for e in chat), name
    fmt = LogprobsFormat(2, True, tok.token_bytes)
    odd = fmt.format(0, [(ids[0], float("-inf"), [(ids[0], float("nan")), (1, -1e6)])])
    json.dumps(odd, allow_nan=False)  # raises on a non-finite value
    entry = odd["content"][0]
    assert entry["logprob"] == -9999.0 and [t["logprob"] for t in entry["top_logprobs"]] == \
        [-9999.0, -9999.0]


def _is_partial(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def _token_bytes(token: str) -> bytes:
    """The bytes of a completions `tokens` string (`bytes:\\xNN...` for a partial character)."""
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in token[len("bytes:"):].split("\\x")[1:])
    return token.encode()


def test_ctrl_c_stops_every_rank_cleanly(server):
    _, port, proc, lines = server
    code, _ = _post(port, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert code == 200
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
    rest = proc.stdout.read()
    proc.wait(timeout=60)
    out = "".join(lines) + rest
    assert "server stopped" in out, out[-3000:]
    # the start-up's objects left the collector's generations (inference/core_client.py
    # `freeze_heap`): a full collection of them stalled a step for ~0.6 s
    frozen = re.search(r"([\d,]+) objects of the start-up moved out", out)
    assert frozen and int(frozen.group(1).replace(",", "")) > 10_000, out[-3000:]
    # torchrun itself reports the signal it got; no worker may fail or print a traceback
    assert REPO + "/inference" not in out and REPO + "/infer.py" not in out, out[-3000:]
    assert "ChildFailedError" not in out and "exitcode" not in out, out[-3000:]
