"""Run train.py under torchrun in a subprocess and read back its metrics.jsonl."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Popen keywords that put the child (torchrun, a server) at the head of a process group of its
# own, so that os.killpg(proc.pid, ...) reaches it and every worker it started
OWN_PROCESS_GROUP = ({"process_group": 0} if sys.version_info >= (3, 11)
                     else {"preexec_fn": os.setpgrp})


def run_train(nproc: int, args: list[str], log_dir: Path, timeout: int = 300,
              env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node nproc train.py *args --log-dir log_dir`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(REPO / "train.py"), *args, "--log-dir", str(log_dir)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}): {' '.join(cmd)}\n"
                             f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def run_main(main, argv: list) -> subprocess.CompletedProcess:
    """`main(argv)` of an entry point (train.py, a tools/ script) in this process, as its
    command line would run it: (exit code: main's return value, a SystemExit's code, e.g.
    argparse's 2; its stdout; its stderr) with no interpreter start (2-3 s of imports each
    on 2 cores). Keep one real subprocess per entry point where the process itself is the
    check (its `__main__`, a traceback-free exit, peak memory)."""
    import contextlib
    import io

    argv = [str(a) for a in argv]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
    return subprocess.CompletedProcess(argv, code or 0, out.getvalue(), err.getvalue())


def train_main_worker(argvs: list[list[str]], cache: str | None = None
                      ) -> list[tuple[int, str, str]]:
    """In a tests/distributed.py `run_distributed` world: `train.main(argv)` per argument
    list, one after the other (each builds its own grid; the world's process group is
    reused, which saves a torchrun launch and the imports per run); per run its exit code,
    stderr and stdout. `cache`: SHARDZOO_CACHE for the runs (the default corpus)."""
    import contextlib
    import io

    import parallel_state as ps
    import train

    if cache is not None:
        os.environ["SHARDZOO_CACHE"] = cache
    out = []
    for argv in argvs:
        ps.destroy_model_parallel()  # pretrain builds the grid from the config
        err, text = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(text):
            code = train.main(argv)
        out.append((code, err.getvalue(), text.getvalue()))
    return out


def train_in_one_world(nproc: int, argvs: list[list[str]], cache: str | None = None,
                       timeout: int = 600) -> list[str]:
    """`train.py` once per argument list (each with its own --log-dir), all in one spawned
    world of `nproc` processes: rank 0's stdout of each run; AssertionError with the stderr
    of the first run that failed."""
    from distributed import run_distributed

    results = run_distributed(train_main_worker, nproc, argvs, cache, timeout=timeout)[0]
    for argv, (code, err, _) in zip(argvs, results):
        assert code == 0, f"train.py {' '.join(argv)} exited {code}:\n{err[-6000:]}"
    return [out for _, _, out in results]


def read_metrics(log_dir: Path) -> list[dict]:
    with open(log_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def train_losses(log_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(log_dir) if "loss" in r]


def read_until(proc: subprocess.Popen, lines: list[str], text: str, count: int = 1) -> None:
    """Read `proc`'s output into `lines` until `text` has appeared on `count` lines (e.g. a
    server's "serving ... on"); AssertionError with the output's tail if it exits first."""
    for line in proc.stdout:
        lines.append(line)
        if sum(text in x for x in lines) >= count:
            return
    raise AssertionError(f"no '{text}' in the output:\n" + "".join(lines[-60:]))


_MEASURED = """import resource, runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    print(f"\\npeak_rss_kib {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", file=sys.stderr)
"""


def start_measured(argv: list[str], env: dict | None = None) -> subprocess.Popen:
    """`python *argv` (a script of the repository and its arguments) in the repository, its
    stdout and stderr together; `finish_measured` waits for it. Started from a shell, not
    forked from this process: a process forked from a large one starts its peak memory
    (getrusage ru_maxrss) at the parent's size, exec or not."""
    return subprocess.Popen(["/bin/sh", "-c", '"$@"; exit $?', "sh", sys.executable, "-c",
                             _MEASURED, *argv], cwd=REPO, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish_measured(proc: subprocess.Popen, timeout: int = 180) -> tuple[int, str, float]:
    """(exit code, output, peak resident memory of the process in MiB: its getrusage
    ru_maxrss, what /usr/bin/time reports) of a `start_measured` process; one that runs past
    `timeout` seconds (a hang) is killed and AssertionError raised."""
    try:
        out = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        out = proc.communicate()[0]
        raise AssertionError(f"{proc.args[7:]} still ran after {timeout} s:\n{out[-2000:]}")
    body, _, peak = out.rpartition("peak_rss_kib ")
    return proc.returncode, body.rstrip(), int(peak) / 1024


def start_measured_cases(argvs: list[list[str]], preload: list[str], timeout: int = 300,
                         env: dict | None = None) -> subprocess.Popen:
    """`python *argv` for each argument list, measured like `start_measured` but in one
    interpreter started from a shell: it imports the `preload` modules (torch: 2-3 s on 2
    cores) once, then forks one child per case that runs the script as `__main__` (its
    `sys.exit(main())`, with `sys.argv` = argv) with stdout and stderr in a file of its own. A
    forked child's getrusage ru_maxrss starts at the parent's resident size, not at the peak
    its imports reached: a case's peak is the larger of the child's and the imports' (what
    a fresh interpreter that imported the same modules reaches, measured per case); a case
    still running after `timeout` seconds is killed by SIGALRM (a hang).
    `finish_measured_cases` waits for them."""
    import json

    proc = subprocess.Popen(["/bin/sh", "-c", '"$@"; exit $?', "sh", sys.executable, "-c",
                             _MEASURED_CASES, json.dumps(preload),
                             json.dumps([[str(a) for a in argv] for argv in argvs]),
                             str(timeout)],
                            cwd=REPO, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    proc.case_timeout = timeout * len(argvs) + 120  # the imports and every case
    return proc


def finish_measured_cases(proc: subprocess.Popen) -> list[tuple[int, str, float]]:
    """Per case of a `start_measured_cases` process: (exit code, output, peak resident
    memory of its child in MiB); AssertionError naming the case that ran past its timeout."""
    import json

    try:
        out = proc.communicate(timeout=proc.case_timeout)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        out = proc.communicate()[0]
    _, found, tail = out.rpartition("\nmeasured_cases ")
    assert proc.returncode == 0 and found, f"the cases' process failed:\n{out[-3000:]}"
    results = []
    for argv, code, text, imports_peak in json.loads(tail):
        if code == -14:  # SIGALRM
            raise AssertionError(f"{argv} still ran after its timeout:\n{text[-2000:]}")
        body, _, peak = text.rpartition("peak_rss_kib ")
        results.append((code, body.rstrip(), max(int(peak), imports_peak) / 1024))
    return results


_MEASURED_CASES = """import atexit, json, os, resource, runpy, signal, sys, tempfile, traceback
preload, cases, timeout = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
for name in preload:
    __import__(name)
parent_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the imports' transient peak


def child(argv):
    sys.argv, sys.path[0] = argv, os.path.dirname(os.path.abspath(argv[0]))
    signal.alarm(timeout)
    code = 0
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    print(f"\\npeak_rss_kib {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", file=sys.stderr,
          flush=True)
    os._exit(code)


results = []
for argv in cases:
    with tempfile.TemporaryFile() as f:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            child(argv)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        f.seek(0)
        results.append([argv, code, f.read().decode(errors="replace"), parent_peak])
print("\\nmeasured_cases " + json.dumps(results))
"""
