"""What the entry points say while they start: infer.py's loading steps on rank 0 only (other
ranks' transformers progress bars kept quiet), the speculative decoding line, the demo
corpus's tokenizing progress, and the shared rate-limited progress log."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from launch import REPO


def test_progress_log_is_rate_limited():
    """Nothing before `first` seconds, then at most one line every `every` seconds; the
    line's function is called only for a line said; `say` None says nothing."""
    from checkpoint.progress import ProgressLog, format_duration

    now, said, made = [0.0], [], []

    def line(elapsed):
        made.append(elapsed)
        return f"at {format_duration(elapsed)}"

    log = ProgressLog(said.append, first=5.0, every=15.0, clock=lambda: now[0])
    for _ in range(100):  # one call per second for 100 s
        now[0] += 1.0
        log(line)
    assert said == ["at 00:05", "at 00:20", "at 00:35", "at 00:50", "at 01:05", "at 01:20",
                    "at 01:35"]
    assert len(made) == len(said)
    quiet = ProgressLog(None, first=0.0, clock=lambda: now[0])
    assert quiet("x") is False
    assert format_duration(3723) == "1:02:03" and format_duration(-3) == "00:00"


@pytest.mark.parametrize("quantization", ["keep", "none"])
def test_infer_says_what_it_loads_on_rank_0_only(tmp_path, quantization):
    """`torchrun --nproc-per-node 2 infer.py --hf tiny.gguf --tp 2`: rank 0 says each step
    (the GGUF header, reading the tensors, the model's size, the weights, the tokenizer, the
    engine, speculative decoding) once and in order. By default the tensors are mapped as
    stored (no transformers bar at all); with `--quantization none` transformers de-quantizes
    and its bar shows once (rank 0's), not interleaved with rank 1's. Before: nothing until
    the bars of both ranks, and no line saying speculative decoding was on."""
    from gguf_files import tiny_gguf
    from test_finetune import _tokenizer

    tok = str(tmp_path / "tokenizer")
    _tokenizer(tok, open(os.path.join(os.path.dirname(os.__file__), "textwrap.py")).read())
    _, gguf_path, _ = tiny_gguf("qwen3", tmp_path, tok)
    extra = ["--quantization", "none"] if quantization == "none" else []
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", "infer.py", "--hf", gguf_path, "--tp", "2", "--prompt", "hello there",
         "--max-new-tokens", "3", "--max-model-len", "64", "--max-batch-size", "2",
         "--num-speculative-tokens", "2", *extra],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = proc.stderr.replace("\r", "\n")
    tensors = ("] de-quantizing the tensors of qwen3.gguf (transformers)" if extra else
               "] mapping the tensors of qwen3.gguf as stored (no de-quantization)")
    steps = ["] reading the GGUF metadata of " + gguf_path, tensors,
             "] loading qwen3 from " + gguf_path + " (gguf): 2 layers, hidden 64, heads 4/2",
             "] copying the weights into this rank's share (tp 2, pp 1)",
             "] loading the tokenizer of " + gguf_path,
             "] building the engine (KV cache)",
             "] KV cache: ",
             "] speculative decoding on: ngram, k 2 (prompt lookup of 2..4-token suffixes)"]
    if extra:  # transformers de-quantizes after it has said the model's size
        steps[1], steps[2] = steps[2], steps[1]
    where = []
    for step in steps:
        assert err.count(step) == 1, (step, err[-3000:])
        where.append(err.index(step))
    assert where == sorted(where), err[-3000:]
    bars = [ln for ln in err.splitlines() if ln.startswith("Converting and de-quantizing")]
    if not extra:
        assert bars == [], bars
        return
    assert bars and sum("100%|" in ln for ln in bars) == 1, bars
    assert where[2] < err.index("Converting and de-quantizing") < where[3]


def test_tokenizing_the_demo_corpus_shows_progress(tmp_path, monkeypatch, capsys):
    """Building the demo corpus with a given tokenizer (a fine-tune's new one took 110 s)
    says what it tokenizes, then after 5 s and every 15 s the documents and tokens done and
    the rate; not a line per document. Before: nothing until the corpus was built."""
    import checkpoint.progress as progress
    from data_pipeline import default_corpus
    from test_finetune import _tokenizer

    files = []
    for i in range(40):
        path = tmp_path / f"doc{i:02d}.py"
        path.write_text(f"def f{i}(x):\n    return x + {i}\n" * (i + 1))
        files.append(str(path))
    tok = str(tmp_path / "tok")
    _tokenizer(tok, "".join(open(f).read() for f in files))
    now = [0.0]

    def clock():  # one second a document: each document asks the clock once
        now[0] += 1.0
        return now[0]

    monkeypatch.setattr(default_corpus, "ProgressLog",
                        lambda say, **kw: progress.ProgressLog(say, clock=clock, **kw))
    prefix, _ = default_corpus.ensure_default_corpus(str(tmp_path / "cache"), files=files,
                                                     tokenizer=tok)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"demo corpus: tokenizing 40 files with {tok}"
    ticks = [ln for ln in lines if ln.startswith("demo corpus: tokenizing: ")]
    assert [ln.split(": ")[2].split(" ")[0] for ln in ticks] == ["5/40", "20/40", "35/40"]
    from data_pipeline import IndexedDataset

    ds = IndexedDataset(prefix)
    first5 = sum(len(ds[i]) for i in range(5))
    assert ticks[0] == (f"demo corpus: tokenizing: 5/40 documents, {first5:,} tokens in 00:05 "
                        f"({first5 / 5:,.0f} tokens/s)")
    assert "built the demo corpus" in lines[-1] and len(lines) == 5


def test_diloco_memory_line_names_the_data_parallel_size():
    """DiLoCo at dp 2: the memory line said `no_shard at dp 1` (the wrappers' group, one
    rank); it names dp 2 and that each replica holds whole states. Without DiLoCo the
    sharding group's size stays."""
    from training.arguments import parse_config
    from training.trainer import memory_line

    state = {"total": 3 << 20, "params": 1 << 20, "grads": 1 << 20, "main_params": 0,
             "optimizer_states": 1 << 20, "strategy": "no_shard", "dp": 1, "edp": 1,
             "predicted_total": 3 << 20, "host_total": 0, "nvme_total": 0}
    act = {"activation_bytes_per_microbatch": 1 << 20, "activation_bytes_layers": 1 << 19,
           "activation_bytes_layers_predicted": 1 << 19}
    config = parse_config(["--config", "configs/tiny-llama.yaml", "--diloco-sync-every", "5"])
    config.validate(2)
    line = memory_line(config, state, act, [4 << 20, 4 << 20])
    assert "no_shard at dp 2 (DiLoCo: each replica holds whole states" in line, line
    assert "at dp 1" not in line
    plain = parse_config(["--config", "configs/tiny-llama.yaml",
                          "--use-distributed-optimizer"])
    plain.validate(2)
    line = memory_line(plain, dict(state, strategy="optim", dp=2, edp=2), act, [4 << 20, 4 << 20])
    assert "; optim at dp 2, ZeRO formula 3.0)" in line, line


def test_report_comm_over_a_diloco_period_prints_whole_calls():
    """--report-comm under DiLoCo counts one outer step of H steps: the counts printed and
    recorded are the totals (whole calls, e.g. 9 over 4 steps) beside the planner's H
    synchronous steps, and the record says how many steps; before, per-step means printed
    as "2.25 calls". One step: as before."""
    from planner.communication import step_communication
    from planner.report import comm_report, run_end_summary
    from training.arguments import parse_config

    config = parse_config(["--config", "configs/tiny-llama.yaml", "--diloco-sync-every", "5",
                           "--eval-interval", "5"])
    config.validate(2)
    one = step_communication(config, False)
    key = sorted(one)[0]
    counted = {key: (9, 9 * 1000 + 4), ("dp", "all_gather_object"): (1, 10)}
    rec, lines = comm_report(config, counted, 6, first_step=False, steps=4)
    assert rec["steps"] == 4
    row = next(r for r in rec["comm"] if (r["group"], r["op"]) == key)
    assert (row["calls"], row["bytes"]) == (9, 9004)
    assert (row["predicted_calls"], row["predicted_bytes"]) == (4 * one[key][0], 4 * one[key][1])
    for line in lines[:len(rec["comm"])]:
        counts = line.split("|")[0].split()[-4::2] + line.split("|")[1].split()[-4::2]
        assert [c.replace(",", "").isdigit() for c in counts] == [True] * 4, line
    assert "over the 4 counted steps" in run_end_summary(config, rec, None)[1]
    single, _ = comm_report(config, {key: one[key]}, 2, steps=1)
    assert single["steps"] == 1 and single["comm_ratio"] is not None
    assert "per step" in run_end_summary(config, single, None)[1]
