"""The hang doctor: timeouts on every group, the collective trace, its dumps and
report, and --debug-collectives.

Broken programs (tests/hang_programs.py) run under torchrun with a 2 s operation timeout;
each must end within the timeout plus a bounded margin, and the report must name the rank,
the op and the call site (file:line). One world of 4 gloo processes checks the rest: a healthy
training run keeps its losses with the trace and --debug-collectives on, every group gets the
timeout and a grid group times out at it, the trace of a consistent program (which the report
finds nothing wrong with), the watchdog, and the debug checks.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from distributed import run_distributed
from launch import OWN_PROCESS_GROUP, REPO, run_main

PROGRAMS = REPO / "tests" / "hang_programs.py"
TIMEOUT_S = 2.0
MARGIN_S = 5.0  # dump, report and teardown after the timeout (loaded 2-core machine)
SUITE_TIMEOUT_S = 30.0  # the in-process suite's groups (ranks may lag on a loaded machine)


def line_of(text: str, path: Path = PROGRAMS) -> str:
    """`tests/hang_programs.py:N` of the line holding `text` (so edits do not break tests)."""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if text in line:
            return f"{path.relative_to(REPO)}:{n}"
    raise AssertionError(f"{text!r} not in {path}")


def start_program(case: str, log_dir: Path, *extra: str, nproc: int = 2,
                  timeout_s: float = TIMEOUT_S, **kw) -> subprocess.Popen:
    """torchrun tests/hang_programs.py CASE in a process group of its own (see `finish`)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(PROGRAMS), case, str(log_dir),
           "--timeout-s", str(timeout_s), *extra]
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            text=True, **OWN_PROCESS_GROUP, **kw)


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
    """Wait for the launch; past `timeout`, kill torchrun and its workers (its process group)."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # workers left behind by a failed launch


def run_program(case: str, log_dir: Path, *extra: str, **kw) -> subprocess.CompletedProcess:
    proc = start_program(case, log_dir, *extra, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         **kw)
    out, err = finish(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def report_of(log_dir: Path, as_process: bool = False) -> tuple[str, list[str]]:
    """tools/hang_report.py's output, and its findings' paragraphs: its `main` in this
    process, or (`as_process`) the command started as a process."""
    from tools import hang_report

    proc = (subprocess.run([sys.executable, str(REPO / "tools" / "hang_report.py"),
                            str(log_dir / "hang")], capture_output=True, text=True, timeout=60)
            if as_process else run_main(hang_report.main, [log_dir / "hang"]))
    assert proc.returncode == 1, proc.stdout + proc.stderr  # 1: something disagrees
    text = proc.stdout.split("\nEvidence")[0]
    return proc.stdout, [p.strip() for p in text.split("\n\n")[1:]]


def check_bounded(log_dir: Path, proc: subprocess.CompletedProcess) -> None:
    """It failed, rank 0 printed the report itself, and every dump came within the timeout
    plus MARGIN_S of the trace's start."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "shardzoo hang report" in proc.stderr, proc.stderr[-3000:]
    assert (log_dir / "hang" / "report.txt").exists()
    started, dumped = [], []
    for path in (log_dir / "hang").glob("rank-*.txt"):
        lines = path.read_text().splitlines()
        started.append(json.loads(lines[1][len("header "):])["started"])
        reasons = lines[lines.index("== reasons") + 1:]
        dumped += [float(r.split(" ", 1)[0]) for r in reasons[:reasons.index(
            next(x for x in reasons if x.startswith("== ")))]]
    assert dumped, "no rank dumped"
    assert max(dumped) - min(started) < TIMEOUT_S + MARGIN_S, (min(started), dumped)


def first_finding(log_dir: Path, as_process: bool = False) -> str:
    out, findings = report_of(log_dir, as_process)
    assert findings, out
    return findings[0]


# ----------------------------------------------------------------------------- broken programs
def test_skipped_all_reduce(tmp_path):
    proc = run_program("skip_all_reduce", tmp_path)
    check_bounded(tmp_path, proc)
    f = first_finding(tmp_path, as_process=True)  # the command line once; in-process elsewhere
    sync, batch = line_of("collectives.all_reduce(flat"), line_of("collectives.broadcast(batch")
    assert "collective #4" in f and f"rank 0 calls all_reduce SUM float32[10] at {sync}" in f, f
    assert f"rank 1 calls broadcast src 0 float32[4, 4] at {batch}" in f, f
    assert f"Rank 1 made that all_reduce at {sync}" in f and "skipped it" in f, f
    # the printed report stands out: framed, and torchrun's failure summary (the last lines
    # on screen) points at it, with the first finding from rank 0
    assert f"{'=' * 100}\nshardzoo hang report for {tmp_path / 'hang'}" in proc.stderr
    assert f"(end of the hang report; also in {tmp_path / 'hang' / 'report.txt'})" in proc.stderr
    summary = proc.stderr.split("Root Cause")[-1]
    assert "traceback : shardzoo hang doctor: Ranks of group world/dp [0, 1] disagree at its " \
           "collective #4: different collectives. The report (rank 0 prints it) is in " \
           f"{tmp_path / 'hang' / 'report.txt'}" in summary, summary
    assert proc.stderr.count("shardzoo hang doctor: Ranks of group world/dp") >= 3  # each rank


def test_mismatched_shapes(tmp_path):
    proc = run_program("shape_mismatch", tmp_path)
    # gloo either times out or aborts the process whose buffer is too small
    check_bounded(tmp_path, proc)
    f = first_finding(tmp_path)
    site = line_of("collectives.all_reduce(x, group")
    assert "tensors of different shapes or dtypes" in f, f
    assert f"rank 0 calls all_reduce SUM float32[8] at {site}" in f, f
    assert f"rank 1 calls all_reduce SUM float32[6] at {site}" in f, f


def test_debug_collectives_turns_the_mismatch_into_an_error(tmp_path):
    proc = run_program("shape_mismatch", tmp_path, "--debug-collectives", timeout_s=60)
    assert proc.returncode != 0
    site = line_of("collectives.all_reduce(x, group")
    for rank in (0, 1):
        text = (tmp_path / "hang" / f"rank-{rank}.txt").read_text()
        assert "CollectiveMismatchError: --debug-collectives: the ranks of group world/dp " \
               "[0, 1] disagree at its collective #1: rank 0: all_reduce SUM float32[8] at " \
               f"{site}" in text, text[:3000]
        assert "rank 1: all_reduce SUM float32[6]" in text
        calls = text.split("== calls")[1].split("== python")[0]
        failed = [line for line in calls.splitlines() if line.startswith("E")]
        start, end = float(failed[0].split("\t")[2]), float(failed[0][1:19])
        assert end - start < 5, failed  # immediate, not after the 60 s timeout


def test_unmatched_pipeline_send(tmp_path):
    proc = run_program("unmatched_send", tmp_path, "--pp", "2")
    check_bounded(tmp_path, proc)
    f = first_finding(tmp_path)
    send, recv = line_of("p2p.send_forward(spec"), line_of("p2p.recv_forward(spec)")
    assert f"Rank 0's p2p send #2 to rank 1 (tag 0, float32[8,2,16]) at {send} " \
           f"(unmatched_send) has no matching receive: rank 1 has posted 1 receives from rank 0 " \
           f"with tag 0, the last at {recv} (unmatched_send)." in f, f
    assert f"Rank 1 is in barrier #1 of group world/pp at {line_of('collectives.barrier()')}" in f


@pytest.mark.parametrize("case,how", [("rank_dies", "exited with RuntimeError: simulated "
                                                    "failure on rank 1 at step 1 (raised at "),
                                      ("rank_killed", "was killed without a chance to write")])
def test_rank_that_dies_mid_step(case, how, tmp_path):
    proc = run_program(case, tmp_path)
    check_bounded(tmp_path, proc)
    f = first_finding(tmp_path)
    assert f"Rank 1 never joined" in f and how in f, f
    if case == "rank_dies":
        assert line_of('raise RuntimeError(f"simulated') in f, f


def test_sigusr1_dumps_a_blocked_rank_and_the_run_continues(tmp_path):
    proc = start_program("wait_for_go", tmp_path, timeout_s=60, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT)
    ring, dump = tmp_path / "hang" / "rank-0.ring", tmp_path / "hang" / "rank-0.txt"
    try:
        deadline = time.monotonic() + 90
        while not (ring.exists() and b"\nR " in b"\n" + ring.read_bytes()):  # rank 0 blocked
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        pid = json.loads(ring.read_bytes()[:65536].decode().strip())["pid"]
        os.kill(pid, signal.SIGUSR1)
        while not dump.exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        (tmp_path / "go").touch()
        out, _ = finish(proc, timeout=60)
    assert proc.returncode == 0, out
    text = dump.read_text()
    assert "SIGUSR1: dump on request" in text
    site = line_of("collectives.all_reduce(torch.ones(3)")
    assert f"all_reduce SUM float32[3]\t{site}" in text  # the in-flight call
    assert f'File "{REPO / site.split(":")[0]}", line {site.split(":")[1]} in wait_for_go' \
           in text  # the main thread's stack, taken while it was blocked in gloo
    assert not ring.exists()  # a clean end removes the ring; the requested dump stays


# ----------------------------------------------------------------------------- the layer
HEALTHY = ["--config", "configs/tiny-llama.yaml", "--tp", "2", "--pp", "2", "--sequence-parallel",
           "--train-iters", "3", "--eval-interval", "0", "--hidden-dropout", "0",
           "--attention-dropout", "0", "--log-interval", "1", "--peak-tflops", "1"]


def _layer_suite(log_dir: str, env: dict) -> dict:
    import torch.distributed as dist

    import parallel_state as ps
    from parallel_state import collectives, p2p
    from parallel_state.hang_doctor import debug_collectives, trace, trace_report
    from training.arguments import parse_config
    from training.trainer import pretrain

    out = {}
    rank = dist.get_rank()
    ps.destroy_model_parallel()

    # a healthy run: the same losses with the trace off, and with the trace on plus the checks
    os.environ.update(env)
    for name, extra in (("off", ["--collective-trace-size", "0"]), ("on", ["--debug-collectives"])):
        run_dir = os.path.join(log_dir, name)
        records = pretrain(parse_config(HEALTHY + extra + ["--log-dir", run_dir]))
        out[f"losses_{name}"] = [r["loss"] for r in records if "loss" in r]
    dist.barrier()  # every rank has removed its trace files
    out["hang_dir_left"] = os.path.exists(os.path.join(log_dir, "on", "hang"))
    collectives.set_timeout(timedelta(seconds=SUITE_TIMEOUT_S))
    collectives.apply_timeout(None)
    ps.initialize_model_parallel(2, 2, device="cpu")
    groups = {"world": None, "tp": ps.get_tensor_model_parallel_group(),
              "dp": ps.get_data_parallel_group(), "pp": ps.get_pipeline_model_parallel_group(),
              "mp": ps.get_model_parallel_group(), "embedding": ps.get_embedding_group(),
              "checkpoint": collectives.new_group(backend="gloo", label="checkpoint")}
    out["timeouts"] = {k: (g or dist.distributed_c10d._get_default_group())._get_backend(
        torch.device("cpu")).options._timeout.total_seconds() for k, g in groups.items()}
    out["labels"] = {k: collectives.group_label(g) for k, g in groups.items()}

    # the trace of a consistent program: seq numbers, p2p channels, call sites, no findings
    tracer = trace.start_trace(log_dir, size=8)
    x = torch.ones(3)
    collectives.all_reduce(x, group=groups["tp"])
    spec = p2p.TensorSpec(((2, 3),), torch.float32, torch.device("cpu"))
    for _ in range(2):
        p2p.send_forward(spec, (torch.ones(2, 3),))
        got = p2p.recv_forward(spec)
    work = collectives.all_reduce(x, group=groups["pp"], async_op=True)
    out["in_flight_before_wait"] = len(tracer.in_flight)
    work.wait()
    out["x"] = x.tolist()
    out["received"] = None if got is None else got[0].tolist()
    collectives.barrier()
    out["lines"] = tracer.lines()
    collectives.barrier()
    if rank == 0:
        traces, _ = trace_report.load(os.path.join(log_dir, "hang"))
        out["findings"] = [f.text for f in trace_report.analyze(traces)]
    collectives.barrier()

    # --debug-collectives: agreeing calls pass, disagreeing ones raise on every rank
    debug_collectives.enable()
    y = torch.ones(4)
    collectives.all_reduce(y, group=groups["tp"])
    out["debug_ok"] = y.tolist()
    try:
        collectives.all_reduce(torch.ones(4 + ps.get_tensor_model_parallel_rank()),
                               group=groups["tp"])
    except debug_collectives.CollectiveMismatchError as e:
        out["debug_mismatch"] = str(e)
    collectives.all_reduce(y, group=groups["tp"])  # the group still works
    out["debug_after"] = y.tolist()
    debug_collectives.disable()

    # the watchdog: a call in flight past timeout + grace leaves a dump
    tracer.reported = True  # no automatic report from rank 0 inside this test world
    call = collectives.Call("all_reduce", dist.distributed_c10d._get_default_group(), (x,))
    collectives._begin(call)
    out["stalled"] = tracer.check_stalls(now=call.t_start + SUITE_TIMEOUT_S + 6)
    collectives._end(call, None)
    out["watchdog_dump"] = "watchdog: all_reduce" in open(tracer.text_path).read()
    os.remove(tracer.text_path)
    collectives.barrier()

    # a grid group times out at the operation timeout (rank 1 waits in the tp all-reduce that
    # rank 0 never joins); with --debug-collectives a p2p shape mismatch is an error on the
    # receiving side (rank 2), and the sender (rank 0) then fails as its message is not taken
    collectives.set_timeout(timedelta(seconds=TIMEOUT_S))
    collectives.apply_timeout(groups["tp"])
    collectives.apply_timeout(groups["pp"])
    if rank == 1:
        try:
            collectives.all_reduce(x, group=groups["tp"])
        except RuntimeError as e:  # its duration as the trace saw it (the dump follows)
            failed = tracer.lines()[-1].split("\t")
            out["timeout_error"] = (str(e)[:200], float(failed[0][1:]) - float(failed[2]))
    elif rank in (0, 2):
        debug_collectives.enable()
        wrong = p2p.TensorSpec(((2, 3 + rank // 2),), torch.float32, torch.device("cpu"))
        try:
            if rank == 0:
                p2p.send_forward(wrong, (torch.ones(2, 3),))
            else:
                p2p.recv_forward(wrong)
        except RuntimeError as e:  # CollectiveMismatchError is one
            out["p2p_debug"] = f"{type(e).__name__}: {e}"[:400]
        debug_collectives.disable()
        if rank == 0:  # alive (only absent) while rank 1 waits for it
            time.sleep(TIMEOUT_S + 0.5)
    else:
        time.sleep(TIMEOUT_S + 0.5)
    trace.stop_trace(remove=False)
    return out


@pytest.fixture(scope="module")
def layer(tmp_path_factory, corpus_env):
    log_dir = tmp_path_factory.mktemp("layer")
    return run_distributed(_layer_suite, 4, str(log_dir), corpus_env, tp=2, pp=2, timeout=300)


def test_trace_and_debug_collectives_keep_the_losses(layer):
    for r in layer:
        assert len(r["losses_on"]) == 3 and r["losses_on"] == r["losses_off"]
        assert not r["hang_dir_left"]  # removed after the final barrier of a clean run


def test_every_group_gets_the_timeout_and_a_label(layer):
    for rank, r in enumerate(layer):
        assert set(r["timeouts"].values()) == {SUITE_TIMEOUT_S}, (rank, r["timeouts"])
        assert r["labels"] == {"world": "world", "tp": "tp", "dp": "dp", "pp": "pp", "mp": "mp",
                               "embedding": "embedding", "checkpoint": "checkpoint"}, rank


def test_a_grid_group_times_out_at_the_timeout(layer):
    text, elapsed = layer[1]["timeout_error"]
    assert "Timed out" in text
    assert TIMEOUT_S - 0.1 < elapsed < TIMEOUT_S + 1.5, elapsed


def test_trace_of_a_consistent_program(layer):
    for rank, r in enumerate(layer):
        assert r["x"] == [4.0] * 3 and r["in_flight_before_wait"] == 1
        fields = [line.split("\t") for line in r["lines"]]
        assert all(f[0][0] == "D" for f in fields), r["lines"]  # every call ended
        ops = [(f[6].split(" ")[0], f[5]) for f in fields]
        stage = rank // 2
        assert ops == [("all_reduce", "1"), ("batch_isend_irecv", "1"),
                       ("batch_isend_irecv", "2"), ("all_reduce", "1"), ("barrier", "1")], ops
        kind = "send>" if stage == 0 else "recv<"
        assert f"{kind}{rank + 2 if stage == 0 else rank - 2} tag 0 #2 float32[2, 3]" in \
            fields[2][6], fields[2]
        site = line_of("collectives.all_reduce(x, group=groups", Path(__file__))
        assert fields[0][7].startswith(f"{site} (_layer_suite)"), fields[0]
        assert r["received"] == (None if stage == 0 else [[1.0] * 3] * 2)
    assert layer[0]["findings"] == []


def test_debug_collectives_checks(layer):
    for rank, r in enumerate(layer):
        assert r["debug_ok"] == [2.0] * 4 and r["debug_after"] == [4.0] * 4
        m = r["debug_mismatch"]
        assert f"group tp [{rank // 2 * 2}, {rank // 2 * 2 + 1}] disagree at its collective" in m
        assert "all_reduce SUM float32[4] at" in m and "all_reduce SUM float32[5] at" in m, m
    assert "CollectiveMismatchError: --debug-collectives: p2p message #3 from rank 0 to rank 2 " \
           "(tag 0): rank 0 sends float32[2, 3]" in layer[2]["p2p_debug"], layer[2]
    assert "but rank 2 expects float32[2, 4]" in layer[2]["p2p_debug"]
    assert "RuntimeError" in layer[0]["p2p_debug"]  # the sender: its message is never taken


def test_watchdog_dumps_a_call_stuck_past_the_timeout(layer):
    for r in layer:
        assert len(r["stalled"]) == 1 and r["watchdog_dump"]


def test_readme_worked_example_call_sites_match_the_program():
    """The hang doctor guide's worked example quotes call sites `tests/hang_programs.py:N (function)`
    (they were off by one after an edit of the program): each N is a line of that function,
    and the line the collective is made on."""
    import ast
    import re

    source = PROGRAMS.read_text()
    spans = {f.name: (f.lineno, f.end_lineno) for f in ast.walk(ast.parse(source))
             if isinstance(f, ast.FunctionDef)}
    lines = source.splitlines()
    calls = {"next_batch": "broadcast", "sync_grads": "all_reduce"}
    sites = re.findall(r"tests/hang_programs\.py:(\d+) \((\w+)\)",
                       (REPO / "docs" / "guide" / "hang-doctor.md").read_text())
    assert len(sites) >= 10
    for number, function in sites:
        first, last = spans[function]
        assert first < int(number) <= last, (number, function)
        if function in calls:
            assert calls[function] in lines[int(number) - 1], (number, function)
