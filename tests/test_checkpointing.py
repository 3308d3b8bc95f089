"""Checkpointing: exact resume, resume on another layout (incl. ZeRO on/off and a
vocab re-pad), kill -9 during a save, a damaged checkpoint's error, and checkpoint_info.

Float32, dropout 0, tiny-llama (4 query groups so tp 4 works), 6 iterations resumed at 3.
Same layout: bitwise equal losses. Another layout: equal up to float32 rounding, as in the
layout equivalence tests (tests/tolerances.py): TP/PP change the summation order.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launch import REPO, run_main, run_train, train_in_one_world, train_losses, train_main_worker
from tolerances import assert_losses_close, training_chain_terms

COMMON = ["--config", "configs/tiny-llama.yaml", "--num-query-groups", "4", "--train-iters",
          "6", "--eval-interval", "0", "--log-interval", "1", "--peak-tflops", "1"]


def _layout(tp=1, pp=1, distopt=False):
    return ["--tp", str(tp), "--pp", str(pp)] + (["--use-distributed-optimizer"] * distopt)


def _info(path) -> subprocess.CompletedProcess:
    """tools/checkpoint_info.py `path` in this process (tests/test_checkpoint_trust.py runs
    its command line as a process)."""
    from tools import checkpoint_info

    return run_main(checkpoint_info.main, [path])


def _saved_run(nproc: int, args: list[str], root: Path, env: dict) -> tuple[Path, list]:
    """Train `args` (6 iterations, saved at 3 and 6) in `root`, in a spawned world of
    `nproc`: (save folder, losses)."""
    save = root / "save"
    train_in_one_world(nproc, [args + ["--save", str(save), "--save-interval", "3",
                                       "--log-dir", str(root / "a")]], env["SHARDZOO_CACHE"])
    return save, train_losses(root / "a")


REPAD = ["--make-vocab-size-divisible-by", "80"]  # padded vocab 8240 at tp1, 8320 at tp2


@pytest.fixture(scope="module")
def tp1_run(tmp_path_factory, corpus_env):
    """One process, saved at 3 and 6 (shared: it is resumed at (tp2, pp2), and copies of it
    are damaged in test_damaged_or_mismatched_checkpoint_errors)."""
    return _saved_run(1, COMMON + REPAD + _layout(), tmp_path_factory.mktemp("tp1"), corpus_env)


@pytest.fixture(scope="module")
def world4(tmp_path_factory, corpus_env, tp1_run):
    """The four-rank runs one after the other in one spawned world (one start-up): (tp2, dp2)
    saved at 3 and 6, async, with a replica ("saved"); the replica's iteration 3 resumed on
    the same layout ("exact"); the save's iteration 3 resumed at (tp1, pp1, dp4 + ZeRO); and
    tp1_run's iteration 3 resumed at (tp2, pp2). Returns (save, replica, {run: (log dir,
    rank 0's stdout)})."""
    root = tmp_path_factory.mktemp("world4")
    save, replica = root / "save", root / "replica"
    runs = {
        "saved": COMMON + _layout(2, 1) + ["--save", str(save), "--save-interval", "3",
                                           "--async-save", "--save-replica", str(replica)],
        "exact": COMMON + _layout(2, 1) + ["--load", str(replica / "iter_0000003")],
        "tp2dp2-to-dp4zero": COMMON + _layout(1, 1, True) + ["--load",
                                                             str(save / "iter_0000003")],
        "tp1-to-tp2pp2": COMMON + REPAD + _layout(2, 2) + ["--load",
                                                           str(tp1_run[0] / "iter_0000003")],
    }
    outs = train_in_one_world(4, [args + ["--log-dir", str(root / name)]
                                  for name, args in runs.items()], corpus_env["SHARDZOO_CACHE"])
    return save, replica, {name: (root / name, out) for name, out in zip(runs, outs)}


def test_exact_resume_tp2_dp2_async(world4):
    """Save at 3 and 6 (async, with a replica) at (tp2, dp2); resuming the replica's
    iteration 3 on the same layout gives bitwise the same losses 4..6."""
    save, replica, runs = world4
    for root in (save, replica):
        assert sorted(os.listdir(root)) == ["iter_0000003", "iter_0000006",
                                            "latest_checkpointed_iteration.txt"]
        assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert _info(replica / "iter_0000003").returncode == 0
    assert train_losses(runs["exact"][0]) == train_losses(runs["saved"][0])[3:]  # bitwise


@pytest.mark.parametrize("name, dst, extra", [
    # (tp2,pp1,dp2, saved async) -> (tp1,pp1,dp4 + ZeRO)
    ("tp2dp2-to-dp4zero", (1, 1), []),
    # (tp1,pp1,dp1: tp1_run) -> (tp2,pp2): padded vocab 8240 -> 8320 (re-padded on load)
    ("tp1-to-tp2pp2", (2, 2), REPAD),
])
def test_resume_on_other_layout(name, dst, extra, world4, tp1_run):
    _, _, runs = world4
    ref = tp1_run[1] if name.startswith("tp1") else train_losses(runs["saved"][0])
    log, out = runs[name]
    assert f"differs from this run's (tp={dst[0]} pp={dst[1]}" in out, out
    assert "{" not in out.split("differs from this run's")[1].splitlines()[0]
    # losses 4..6 carry the rounding of steps 1..6: compare them as steps 4..6 of one run
    k_step = training_chain_terms(COMMON + extra)
    assert_losses_close(ref[:3] + train_losses(log), ref, k_step)
    assert ref[-1] < ref[0]


def test_kill_during_save_keeps_previous(tmp_path, corpus_env):
    """A rank SIGKILLed after writing its shards of iteration 6 but before the rename: the
    folder stays a .tmp (checkpoint_info lists it as debris), `latest` still says 3, and the
    same command removes it at start-up and resumes from 3."""
    save = tmp_path / "save"
    args = COMMON + ["--save", str(save), "--load", str(save), "--save-interval", "3"]
    proc = run_train(2, args, tmp_path / "a", env={**corpus_env,
                     "SHARDZOO_TEST_KILL_DURING_SAVE": "1:6"}, check=False)
    assert proc.returncode != 0
    ref = train_losses(tmp_path / "a")
    assert len(ref) == 6
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    names = os.listdir(save)
    assert "iter_0000003" in names and "iter_0000006" not in names
    staging = next(n for n in names if n.startswith("iter_0000006.tmp-"))
    info = _info(save)
    assert info.returncode == 0 and "debris (interrupted saves" in info.stdout
    assert staging in info.stdout
    # same command (in a spawned world: rank 0's stdout): resumes from 3
    out, = train_in_one_world(2, [args + ["--log-dir", str(tmp_path / "b")]],
                              corpus_env["SHARDZOO_CACHE"])
    assert f"removed 1 leftover(s) of interrupted saves at start-up: {staging}" in out
    assert not any(".tmp-" in n for n in os.listdir(save))
    assert train_losses(tmp_path / "b") == ref[3:]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "6"


def test_damaged_or_mismatched_checkpoint_errors(tp1_run, tmp_path, corpus_env):
    """On copies of tp1_run's checkpoint: a changed model shape and a truncated shard each
    fail train.py (exit 1, one line naming the field or the file, before any step; both
    loads in one spawned process: train.py's torchrun error path is in test_run_log.py), and
    checkpoint_info reports the shard and a missing metadata.json."""
    from distributed import run_distributed

    save, _ = tp1_run
    bad = tmp_path / "bad"
    shutil.copytree(save, bad)
    shard = next((bad / "iter_0000006").glob("__0_*.distcp"))
    with open(shard, "r+b") as f:
        f.truncate(100)
    args = COMMON + REPAD + ["--train-iters", "9"]  # past the saved 6: not already complete
    (shape_code, shape_err, _), (cut_code, cut_err, _) = run_distributed(
        train_main_worker, 1,
        [args + ["--load", str(save), "--hidden-size", "32", "--log-dir", str(tmp_path / "b")],
         args + ["--load", str(bad), "--log-dir", str(tmp_path / "c")]],
        corpus_env["SHARDZOO_CACHE"], timeout=240)[0]
    # wrong model shape: names the field and the fix, before any step
    assert shape_code == 1, shape_err[-2000:]
    assert "hidden_size: checkpoint 64, this run 32" in shape_err
    # no training step ran: the check runs before the run log is even opened
    assert not (tmp_path / "b" / "metrics.jsonl").exists() or train_losses(tmp_path / "b") == []
    # truncated shard: names the file
    assert cut_code == 1, cut_err[-2000:]
    assert f"{shard} has 100 bytes" in cut_err and "truncated" in cut_err
    info = _info(bad)
    assert info.returncode == 1 and "status: BAD" in info.stdout and str(shard) in info.stdout
    # missing metadata.json (an interrupted copy), checked by the tool (same code as load)
    ckpt = bad / "iter_0000003"
    os.remove(ckpt / "metadata.json")
    info = _info(ckpt)
    assert info.returncode == 1 and "metadata.json is missing" in info.stdout
    assert shard.stat().st_size == 100  # nothing saved is modified by a failed load


def test_checkpoint_flags_validated_up_front(tmp_path):
    from models.config import ConfigError
    from training.arguments import parse_config

    with pytest.raises(ConfigError, match="--load .*nowhere does not exist"):
        parse_config(COMMON + ["--load", str(tmp_path / "nowhere")]).validate(1)
    with pytest.raises(ConfigError, match="--keep-last needs --save"):
        parse_config(COMMON + ["--keep-last", "2"]).validate(1)
    # --load == --save with nothing saved yet is fine: a restarted job starts from scratch
    same = str(tmp_path / "ckpt")
    parse_config(COMMON + ["--load", same, "--save", same]).validate(1)


def _torchrun(nodes_args: list[str], args: list[str], log_dir: Path, env: dict):
    cmd = [sys.executable, "-m", "torch.distributed.run", *nodes_args, "train.py", *args,
           "--log-dir", str(log_dir)]
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(procs, timeout=240) -> list[str]:
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-6000:]
    return outs


RESTART = COMMON + ["--train-iters", "8", "--save-interval", "2", "--keep-last", "2"]


def _snapshot(root: Path) -> dict:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def _check_run_boundaries(log_dir: Path, second: dict, resumed: int) -> None:
    """Both attempts marked their start in metrics.jsonl, and both readers (the documented
    rule and TensorBoard's purge_step) see iterations 1..8 once, those after `resumed` from
    the restart."""
    from launch import read_metrics

    from training.metrics import latest_curve

    records = read_metrics(log_dir)
    starts = [r for r in records if r.get("event") == "run_start"]
    # "restart" is torchelastic's count of this agent's restarts: rank 0's node did not fail,
    # so its agent joined the new rendezvous without counting one (the second node's did)
    assert [(r["restart"], r["resumed_from_iteration"]) for r in starts] == \
        [(0, None), (0, resumed)]
    assert "train.py" in starts[0]["command"] and starts[0]["run_id"] != starts[1]["run_id"]
    curve = [(r["iteration"], r["loss"]) for r in latest_curve(records) if "loss" in r]
    assert [i for i, _ in curve] == list(range(1, 9)) and dict(curve)[6] == second[6]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    tb = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert [s for s, _ in tb] == list(range(1, 9))
    assert tb[5][1] == pytest.approx(second[6], rel=1e-6)  # TensorBoard stores float32


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # train.main's @record
def test_two_node_c10d_restart(tmp_path, corpus_env, capsys, monkeypatch):
    """Two torchrun agents (--nnodes 2, 2 processes each, c10d rendezvous on 127.0.0.1,
    --max-restarts 1): rank 3 (on the second node) is SIGKILLed after iteration 3 on the first
    attempt; both agents restart the group, which resumes from iteration 2 bitwise and
    finishes, keeping the last 2 checkpoints; both attempts are marked in the run log. The
    same job again is already complete and writes nothing."""
    from distributed import free_port

    save = tmp_path / "save"
    nodes = ["--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
             "--rdzv-id", "two-node-test"]
    env = {**corpus_env, "SHARDZOO_TEST_KILL_AT": "3:3"}
    args = RESTART + ["--tp", "2", "--save", str(save), "--load", str(save)]
    procs = [_torchrun(nodes, args, tmp_path / "log", env) for _ in range(2)]
    out = "".join(_finish(procs))
    assert "loaded checkpoint" in out and "at iteration 2" in out
    its = train_losses_records(tmp_path / "log")
    assert [i for i, _ in its] == [1, 2, 3, 3, 4, 5, 6, 7, 8]  # 3 ran twice
    first, second = dict(its[:3]), dict(its[3:])
    assert first[3] == second[3]  # bitwise: same layout, exact resume
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
    assert sorted(n for n in os.listdir(save) if n.startswith("iter")) == \
        ["iter_0000006", "iter_0000008"]  # --keep-last 2
    # the restart took its tokenizer from iter 2, which --keep-last 2 deleted before iter 8
    assert (save / "iter_0000008" / "tokenizer.model").is_file()
    _check_run_boundaries(tmp_path / "log", second, resumed=2)
    # the same job again, at another layout (1 process): already complete, exits 0 and writes
    # nothing. That is decided before any process group or data work, so it runs in this
    # process (a torchrun launch costs ~10 s here).
    import train

    monkeypatch.setenv("SHARDZOO_CACHE", corpus_env["SHARDZOO_CACHE"])
    before = _snapshot(tmp_path)
    capsys.readouterr()
    assert train.main(RESTART + ["--save", str(save), "--load", str(save),
                                 "--log-dir", str(tmp_path / "log")]) == 0
    out = capsys.readouterr().out
    assert "already complete" in out and "iter_0000008 is at iteration 8" in out
    assert _snapshot(tmp_path) == before


def train_losses_records(log_dir: Path) -> list[tuple[int, float]]:
    from launch import read_metrics

    return [(r["iteration"], r["loss"]) for r in read_metrics(log_dir) if "loss" in r]


def test_resume_with_another_global_batch_size_says_so():
    from training.checkpointing import batch_size_notice

    assert batch_size_notice({"global_batch_size": 8}, 8, 10, 80) is None
    assert batch_size_notice({}, 16, 10, 80) is None  # a checkpoint that predates the field
    line = batch_size_notice({"global_batch_size": 8}, 16, 10, 80)
    assert line.startswith("--global-batch-size changed on resume"), line
    assert "used 8, this run 16" in line and "from 10" in line and "sample 80" in line, line
