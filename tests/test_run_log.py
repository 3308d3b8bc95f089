"""What a run tells its user: the log line's rates and ETA, MFU against the peak, the metrics
file's run boundaries, the pipeline balance hint, the vocab notice, the entry point's demo
default and its one-line errors under torchrun. Pure functions are tested in this
process; the torchrun case spawns one short job (the checkpoint tests cover resumes)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from launch import REPO


class _Clock:
    """Durations the trainer would report: steps of `step` seconds, validations of `valid`."""

    def __init__(self, progress, step=1.0, valid=100.0):
        self.p, self.step_s, self.valid_s = progress, step, valid

    def run(self, first, last, log_interval, eval_interval, first_step=None):
        """Iterations first..last as the trainer's loop reports them; the log lines' values."""
        lines = {}
        for it in range(first, last + 1):
            self.p.step(first_step if (it == first and first_step) else self.step_s)
            if it % log_interval == 0 or it == first:
                lines[it] = (self.p.window(), self.p.eta(it))
            if eval_interval and it % eval_interval == 0:
                self.p.other("valid", self.valid_s)
        return lines


def test_rate_and_eta_around_a_validation():
    """The demo's pattern (log every 10, validate every 25): the line after a validation
    (iteration 30) shows the true step time, not the time since the validation ended over
    10 steps (the old 2x overstatement); the ETA counts the validations still to come and
    stays put from line to line instead of swinging with the last window."""
    from training.metrics import Progress

    p = Progress(train_iters=150, eval_interval=25, save_interval=None, save_at_end=False)
    p.other("valid", 100.0)  # the validation at iteration 0
    lines = _Clock(p).run(1, 150, 10, 25, first_step=31.0)
    assert lines[1][0] == 31.0  # the first step alone, warm-up included
    assert lines[30][0] == pytest.approx(1.0)  # 10 steps of 1 s; the validation is not in it
    assert lines[20][0] == lines[30][0] == lines[40][0]
    # after iteration 30: 120 steps of 1 s (the first step's 31 s stays out of the mean) and
    # validations at 50, 75, 100, 125, 150 of 100 s each
    assert lines[30][1] == pytest.approx(120 * 1.0 + 5 * 100.0)
    assert lines[130][1] == pytest.approx(20 * 1.0 + 1 * 100.0)
    # the validation at 50 follows the log line at 50, so that line still counts it
    assert lines[50][1] == pytest.approx(100 * 1.0 + 5 * 100.0)
    # steady: elapsed + eta (the predicted end) is the same on every line after the first
    ends = []
    for it in range(10, 151, 10):
        elapsed = 100.0 + 31.0 + (it - 1) * 1.0 + 100.0 * ((it - 1) // 25)
        ends.append(elapsed + lines[it][1])
    assert ends == pytest.approx([ends[0]] * len(ends)), ends


def test_no_validation_right_before_the_final_one():
    """A 10-iteration fine-tune (validation every 3) validated after 9 and again after 10:
    the final validation stays, the one it follows at once goes; the ETA counts what runs."""
    from training.metrics import Progress, validates_at

    def at(train_iters, interval):
        return [it for it in range(1, train_iters + 1)
                if validates_at(it, train_iters, interval)]

    assert at(10, 3) == [3, 6, 10]
    assert at(12, 3) == [3, 6, 9, 12]
    assert at(10, 4) == [4, 8, 10]
    assert at(11, 2) == [2, 4, 6, 8, 11]
    assert at(5, 1) == [1, 2, 3, 4, 5]  # every iteration, as asked
    assert at(1001, 100)[-2:] == [900, 1001]
    p = Progress(train_iters=10, eval_interval=3, save_interval=None, save_at_end=False)
    p.step(1.0)
    p.step(1.0)
    p.other("valid", 10.0)
    assert p.eta(7) == pytest.approx(3 * 1.0 + 1 * 10.0)  # only the final validation is left
    assert p.eta(6) == pytest.approx(4 * 1.0 + 2 * 10.0)  # the one at 6 follows its line


def test_eta_counts_saves_and_the_final_save():
    from training.metrics import Progress

    p = Progress(train_iters=10, eval_interval=0, save_interval=4, save_at_end=True)
    p.step(9.0)  # warm-up: left out of the mean once a second step exists
    for _ in range(3):
        p.step(2.0)
    assert p.eta(4) == pytest.approx(6 * 2.0)  # no save measured yet
    p.other("save", 5.0)  # the save after iteration 4
    for _ in range(4):
        p.step(2.0)
    assert p.mean_step() == 2.0
    # at iteration 8's log line: 2 steps, the save at 8 and the final one at 10
    assert p.eta(8) == pytest.approx(2 * 2.0 + 2 * 5.0)
    assert p.eta(10) == pytest.approx(1 * 5.0)


def test_long_validation_shows_progress(capsys):
    """A validation of minutes says how far it is (after 10 s, then every 30 s); a short one,
    and every rank but 0, print nothing."""
    from training.metrics import EvalProgress

    def run(total, seconds_per_batch, enabled=True):
        now = [0.0]
        progress = EvalProgress("validation at iter 0", total, enabled, clock=lambda: now[0])
        for done in range(1, total + 1):
            now[0] += seconds_per_batch
            progress(done)
        return capsys.readouterr().out.splitlines()

    lines = run(100, 1.5)  # 150 s: lines at 10.5 s, 40.5 s, ... (batches 7, 27, 47, 67, 87)
    assert lines[0] == "validation at iter 0: 7/100 batches in 00:10, about 02:19 to go"
    assert [line.split(":")[1].split("/")[0].strip() for line in lines] == \
        ["7", "27", "47", "67", "87"]
    assert run(8, 1.0) == [] and run(100, 1.5, enabled=False) == []


def test_latest_curve_supersedes_by_run_start():
    from training.metrics import latest_curve

    records = [
        {"event": "run_start", "resumed_from_iteration": None},
        *({"iteration": i, "loss": 10.0 - i} for i in (1, 2, 3, 4, 5)),  # killed after 5
        {"event": "run_start", "resumed_from_iteration": 4},  # resumed from checkpoint 4
        *({"iteration": i, "loss": 20.0 - i} for i in (5, 6)),
    ]
    curve = latest_curve(records)
    assert [(r["iteration"], r["loss"]) for r in curve] == \
        [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (5, 15.0), (6, 14.0)]
    # a run from scratch in the same folder replaces everything before it
    again = latest_curve(records + [{"event": "run_start", "resumed_from_iteration": None},
                                    {"iteration": 0, "valid_loss": 9.0}])
    assert again == [{"iteration": 0, "valid_loss": 9.0}]


def test_one_peak_per_run_and_mfu_never_over_100_percent(monkeypatch, capsys):
    """The peak is measured once, at start-up; MFU always divides by it; a rate above it is
    'n/a' with one note, never a re-measurement or a figure over 100%."""
    from training import mfu as flops
    from training.mfu import PeakFlops

    calls = []
    monkeypatch.setattr(flops, "measured_matmul_peak",
                        lambda *a, **kw: calls.append(a) or (0.05e12, 1024))  # per thread
    monkeypatch.setattr(flops, "cpu_threads_per_rank", lambda: (2.0, "2 threads"))
    peak = PeakFlops(torch.device("cpu"), torch.float32)
    assert peak.measured and peak.tflops == pytest.approx(0.1) and len(calls) == 1
    assert "measured at start-up: 0.05 TFLOP/s per thread" in peak.source
    assert "x 2 threads" in peak.source
    assert peak.mfu(0.05) == pytest.approx(0.5)
    assert peak.mfu(0.3) is None and peak.mfu(0.1) == pytest.approx(1.0)
    assert peak.tflops == pytest.approx(0.1) and len(calls) == 1  # never measured again
    assert "exceeds the peak 0.1 TFLOP/s (measured at start-up" in peak.note
    assert "--peak-tflops" in peak.note
    peak.say_note(), peak.say_note()
    assert capsys.readouterr().out.count("note: the achieved 0.3 TFLOP/s") == 1
    given = PeakFlops(torch.device("cpu"), torch.float32, given=0.2)
    assert not given.measured and given.mfu(0.1) == pytest.approx(0.5) and len(calls) == 1
    assert given.mfu(0.4) is None and "(--peak-tflops)" in given.note


def test_cpu_peak_is_timed_in_thread_cpu_time_on_one_thread(monkeypatch):
    """A busy machine stretches wall time, not the measuring thread's CPU time: the rate
    follows `time.thread_time` (here 1 ms per matmul) whatever the wall clock does (here 50x
    slower), and the matmuls run on one thread, with the thread count restored after."""
    from training import mfu as flops

    cpu, wall, threads = [0.0], [0.0], []

    def thread_time():
        return cpu[0]

    def perf_counter():
        return wall[0]

    def matmul(a, b):
        threads.append(torch.get_num_threads())
        cpu[0] += 1e-3
        wall[0] += 5e-2

    monkeypatch.setattr(flops.time, "thread_time", thread_time)
    monkeypatch.setattr(flops.time, "perf_counter", perf_counter)
    monkeypatch.setattr(torch, "matmul", matmul)
    monkeypatch.setattr(flops.gemm, "available", lambda: False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rate, n = flops.measured_matmul_peak(torch.float32, torch.device("cpu"), n=1024)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert set(threads) == {1} and n == 1024  # 1 ms per matmul stays under 2 s / 64
    assert rate == pytest.approx(2 * 1024 ** 3 / 1e-3)


def test_cpu_peak_shares_the_host_among_local_ranks(monkeypatch):
    from training.mfu import cpu_threads_per_rank

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cpu_threads_per_rank() == (2.0, "2 threads")  # 2 ranks x 2 threads fit 4 CPUs
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # 8 ranks on 4 CPUs: half a CPU each
    assert cpu_threads_per_rank() == (0.5, "4 CPUs shared by 8 ranks")


def test_pipeline_balance_suggestion():
    """The case: the output layer of a large vocab at a small hidden size costs many
    layers, so the last stage is slow; moving layers to the first stage balances it."""
    from training.timeline import suggest_split

    hint = suggest_split([2.0, 10.0], [4, 4])  # last stage: 4 layers + 16 layers' worth
    assert (hint["first"], hint["last"], hint["better"]) == (7, 1, True)
    assert hint["extra_last"] == pytest.approx(16.0)
    assert hint["predicted_share"] == pytest.approx([3.5 / 12, 8.5 / 12])
    assert not suggest_split([5.0, 5.0], [2, 2])["better"]  # balanced already
    four = suggest_split([1.0, 2.0, 2.0, 10.0], [2, 2, 2, 2])
    assert (four["first"], four["last"]) == (3, 1)  # middle stages stay even: 2 and 2
    even = suggest_split([1.0, 2.0, 2.0, 10.0], [2, 2, 2, 2], vpp=2)  # vpp 2: even stages
    assert (even["first"], even["last"], even["better"]) == (2, 2, False)
    assert suggest_split([1.0, 1.0], [2]) is None


def test_vocab_notice_names_both_sizes():
    from training.arguments import load_model_config
    from training.trainer import vocab_notice

    line = vocab_notice(load_model_config("gpt2-124m"), 8192)
    assert "gpt2-124m (50257)" in line and "8192 tokens" in line
    actual = 124_439_808 - (50257 - 8192) * 768  # GPT-2's count less the dropped embedding rows
    assert f"this run trains {actual / 1e6:.1f}M parameters, not 124.4M" in line
    assert "\n" not in line
    # T5: the sentinels sit on top of the tokenizer, so the named size needs a smaller one
    line = vocab_notice(load_model_config("t5-tiny"), 8192, sentinels=100)
    assert "8192 tokens + 100 sentinels, so the vocabulary of t5-tiny (8192) is replaced by " \
           "8292" in line, line
    assert "made with a 8092-token tokenizer (+ 100 sentinels = 8192)" in line, line


def test_bare_train_py_is_the_demo():
    sys.path.insert(0, str(REPO))
    from train import DEMO, with_demo_default

    from training.arguments import parse_config

    assert with_demo_default([]) == ["--config", str(DEMO)]
    assert with_demo_default(["--train-iters", "5"])[:2] == ["--config", str(DEMO)]
    assert with_demo_default(["--model", "tiny-gpt"]) == ["--model", "tiny-gpt"]
    assert with_demo_default(["--config=x.yaml"]) == ["--config=x.yaml"]
    assert with_demo_default(["--load", "ckpt"]) == ["--load", "ckpt"]  # the checkpoint's model
    c = parse_config(with_demo_default([]))
    assert c.model.name == "small-llama" and c.train.train_iters == 150


def test_torchrun_configuration_error_is_one_line_and_first(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "train.py", "--config", "configs/tiny-llama.yaml", "--global-batch-size", "3",
           "--log-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    line = ("train.py: configuration error: --global-batch-size 3 is not divisible by "
            "--micro-batch-size 2 x data-parallel size 2 = 4; use e.g. --global-batch-size 4")
    assert proc.stderr.splitlines()[0] == line  # first, once
    assert proc.stderr.count(line) == 1 + proc.stderr.count(f"traceback : {line}")
    # torchrun's own summary names it as the root cause (the elastic error file)
    root = proc.stderr.split("Root Cause")[1]
    assert f"traceback : {line}" in root and "To enable traceback" not in root
    assert not (tmp_path / "metrics.jsonl").exists()


_LATE_RANK_0 = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from parallel_state import say_error
rank = int(os.environ["RANK"])
if rank == 0:  # rank 1 says the error first (it writes its error file, then returns)
    other = Path(os.environ["TORCHELASTIC_ERROR_FILE"].replace("/0/error.json", "/1/error.json"))
    while not other.exists():
        time.sleep(0.01)
    time.sleep(1.0)  # long past torchrun's SIGTERM had rank 1 not waited for rank 0
say_error("late.py: configuration error: the same on every rank", rank)
sys.exit(2)
"""


def test_rank_0_says_a_uniform_error_even_when_it_comes_last(tmp_path):
    """Another rank that reaches the error first waits for rank 0's line before it exits,
    so torchrun does not kill rank 0 before it prints (a failure seen under load)."""
    script = tmp_path / "late.py"
    script.write_text(_LATE_RANK_0)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(script), str(REPO)],
                          capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    line = "late.py: configuration error: the same on every rank"
    assert proc.returncode != 0
    assert proc.stderr.splitlines()[0] == line, proc.stderr


def test_metrics_curve_tool(tmp_path):
    rows = [{"event": "run_start", "resumed_from_iteration": None},
            {"iteration": 1, "loss": 3.0}, {"iteration": 2, "loss": 2.5},
            {"event": "run_start", "resumed_from_iteration": 1},
            {"iteration": 2, "loss": 2.0}, {"iteration": 2, "valid_loss": 2.2}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run([sys.executable, "-X", "importtime", "tools/metrics_curve.py",
                          str(tmp_path), "--format", "csv"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["iteration,loss,valid_loss", "1,3,", "2,2,", "2,,2.2"]
    # reading a jsonl needs no torch (importing it took 32 s on a loaded machine)
    imported = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()]
    assert "training.metrics" in imported and "torch" not in imported


def test_already_complete_reads_the_resumed_checkpoint(tmp_path):
    """What counts as "already complete" (the end-to-end rerun is in test_checkpointing):
    the iteration of the checkpoint --load resumes from; --finetune and weights-only
    checkpoints start at 0, so they never do."""
    from types import SimpleNamespace

    from training.checkpointing import completed_checkpoint

    folder = tmp_path / "iter_0000005"
    folder.mkdir()
    meta = {"iteration": 5, "files": [], "layout": {}, "model": {}}
    (folder / "metadata.json").write_text(json.dumps(meta))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5\n")
    def run(**kw):
        return SimpleNamespace(**{"load": str(tmp_path), "save": None, "finetune": False, **kw})
    assert completed_checkpoint(run()) == (str(folder), 5)
    assert completed_checkpoint(run(finetune=True)) is None
    assert completed_checkpoint(run(load=None)) is None
    assert completed_checkpoint(run(load=str(tmp_path / "empty"))) is None
    (folder / "metadata.json").write_text(json.dumps({**meta, "optimizer_state": False}))
    assert completed_checkpoint(run()) is None
