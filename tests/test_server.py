"""`infer.py --serve` under torchrun (tp=2 x dp=2, `--api-key`) answering the official `openai`
client on loopback: both endpoints, streaming and not, n and usage, 32 concurrent requests
equal to their single answers and spread over both replicas, the bad inputs of the API (each
followed by a good request), a missing or wrong API key (401), a client that drops a stream,
and a clean stop on Ctrl-C. One server for the whole module."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from distributed import free_port

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
                            start_new_session=True)
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
        ("/v1/completions", {**good, "logprobs": 2}, None, 400),  # not implemented: refused
        ("/v1/completions", {**good, "echo": True}, None, 400),
        ("/v1/completions", {**good, "response_format": {"type": "json_object"}}, None, 400),
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


def test_ctrl_c_stops_every_rank_cleanly(server):
    _, port, proc, lines = server
    code, _ = _post(port, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert code == 200
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
    rest = proc.stdout.read()
    proc.wait(timeout=60)
    out = "".join(lines) + rest
    assert "server stopped" in out, out[-3000:]
    # torchrun itself reports the signal it got; no worker may fail or print a traceback
    assert REPO + "/inference" not in out and REPO + "/infer.py" not in out, out[-3000:]
    assert "ChildFailedError" not in out and "exitcode" not in out, out[-3000:]
