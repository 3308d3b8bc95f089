"""Run train.py under torchrun in a subprocess and read back its metrics.jsonl."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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
