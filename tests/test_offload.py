"""ZeRO-Infinity's NVMe offload: the scratch folder's checks and cleaning, and crash
safety. The training equivalences (nvme optimizer offload at dp 2 with tp 2 and pp 2 against
one process with torch AdamW; checkpoints across offload and layouts) are cases of
tests/test_distributed_optimizer.py, in its spawned worlds.

- --offload-path is refused before anything is built, naming the path and its free space:
  too little free space (an injected disk_usage: a real full disk cannot be made here), a
  read-only folder (chmod 555; as root, which ignores modes, a folder of /sys no one may write),
  a file, a path that cannot be created; a file-size limit (RLIMIT_FSIZE) below the scratch
  file makes its reservation fail with the same kind of message.
- Stale scratch folders (owning process dead, or its pid reused by a later process) are
  removed; a live process's and another host's are not.
- kill -9 of one rank in the middle of an optimizer step (after the first NVMe shard was
  rewritten, before the others) leaves the last checkpoint loadable; the next start removes
  the killed run's scratch folders and resumes from it.
"""
from __future__ import annotations

import os
import resource
import socket
import subprocess

import pytest
import torch

from data_parallel.offload_files import (PREFIX, OffloadPathError, SwapFile, check_offload_path,
                                         make_scratch, process_start, remove_stale_scratch)

LLAMA = ["--config", "configs/tiny-llama.yaml", "--num-layers", "2"]


def _nvme_config(path):
    from training.arguments import parse_config

    return parse_config(LLAMA + ["--data-parallel-sharding-strategy", "optim_grads",
                                 "--optimizer-offload-device", "nvme", "--offload-path",
                                 str(path)]).validate(1)


def test_offload_path_refused_at_start(tmp_path, monkeypatch):
    from models.config import ConfigError
    from training.offload import offload_scratch_bytes, prepare_offload_path

    ok = tmp_path / "ok"
    config = _nvme_config(ok)
    from planner.parameters import model_state_prediction

    need = offload_scratch_bytes(config)  # main copy and two moments of every element
    assert need == 12 * model_state_prediction(config)["psi_padded"] > 0
    line = prepare_offload_path(config)  # creates the folder; a GiB count and the path
    assert str(ok) in line and "free" in line and ok.is_dir()

    class Full:  # a disk with 1 KiB free
        def __init__(self, free):
            self.free = free

    with pytest.raises(ConfigError, match="free but the scratch files") as e:
        prepare_offload_path(config, disk_usage=lambda p: Full(1024))
    assert str(ok) in str(e.value) and "0.00 GiB free" in str(e.value)
    assert f"{need:,} B each" in str(e.value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # four ranks of this host share the drive
    with pytest.raises(ConfigError, match=f"need {4 * need / 2**30:,.2f} GiB"):
        prepare_offload_path(config, disk_usage=lambda p: Full(3 * need))

    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.access(ro, os.W_OK):  # root ignores the mode: a /sys folder refuses even root
        ro = "/sys/kernel"
    with pytest.raises(ConfigError, match="not writable|cannot write a file there") as e:
        prepare_offload_path(_nvme_config(ro))
    assert str(ro) in str(e.value) and "GiB free" in str(e.value)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ConfigError, match="is not a folder"):
        prepare_offload_path(_nvme_config(afile))
    with pytest.raises(ConfigError, match="cannot create it"):
        prepare_offload_path(_nvme_config(afile / "sub"))
    # the flags themselves
    from training.arguments import parse_config

    def resolved(*flags):
        return parse_config(LLAMA + list(flags)).validate(2).train

    t = resolved("--optimizer-cpu-offload")
    assert (t.optimizer_offload_device, t.optimizer_cpu_offload) == ("cpu", True)
    t = resolved("--optimizer-offload-device", "nvme", "--offload-path", str(ok))
    assert (t.optimizer_offload_device, t.optimizer_offload_fraction) == ("nvme", 1.0)
    for flags, match in [
            (["--optimizer-offload-device", "nvme"], "needs --offload-path"),
            (["--offload-path", str(ok)], "only used by nvme offload"),
            (["--optimizer-offload-device", "disk"], "optimizer-offload-device"),
            (["--optimizer-cpu-offload", "--optimizer-offload-device", "nvme",
              "--offload-path", str(ok)], "contradicts"),
            (["--param-offload-device", "cpu"], "needs --data-parallel-sharding-strategy"),
            (["--optimizer-offload-device", "nvme", "--offload-path", str(ok),
              "--offload-buffer-count", "1"], "must be >= 2")]:
        with pytest.raises(ConfigError, match=match):
            resolved(*flags)


def test_swap_file_limits(tmp_path):
    f = SwapFile(str(tmp_path), "x.bin", 64, threads=1)
    src = torch.arange(16, dtype=torch.float32)
    f.write(0, src).result()
    out = torch.empty(8)
    f.read(32, out).result()
    assert torch.equal(out, src[8:])
    with pytest.raises(ValueError, match="outside"):
        f.read(40, torch.empty(8)).result()
    f.close()
    assert not (tmp_path / "x.bin").exists()
    # a file-size limit below the file: refused at reservation, with the path and free space
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        with pytest.raises(OffloadPathError, match=r"cannot reserve .* GiB free"):
            SwapFile(str(tmp_path), "big.bin", 8 << 20)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert not (tmp_path / "big.bin").exists()
    with pytest.raises(OffloadPathError, match="free but"):
        check_offload_path(str(tmp_path), 1 << 70, what="test files")


def test_stale_scratch_removed_live_kept(tmp_path):
    host = socket.gethostname()
    dead = _dead_pid()
    me, start = os.getpid(), process_start(os.getpid())
    names = {
        "dead": f"{PREFIX}rank0.{dead}.x.00aa.{host}",
        "reused": f"{PREFIX}rank1.{me}.{int(start) + 1}.00bb.{host}",  # our pid, not us
        "live": f"{PREFIX}rank2.{me}.{start}.00cc.{host}",
        "other_host": f"{PREFIX}rank0.{dead}.x.00dd.{host}-elsewhere",
        "foreign": "my-own-files"}
    for n in names.values():
        (tmp_path / n).mkdir()
        (tmp_path / n / "optimizer.bin").write_bytes(b"\0" * 8)
    mine = make_scratch(str(tmp_path), 3)  # this process's: live
    removed = remove_stale_scratch(str(tmp_path))
    assert sorted(removed) == sorted([names["dead"], names["reused"]])
    left = set(os.listdir(tmp_path))
    assert left == {names["live"], names["other_host"], names["foreign"], os.path.basename(mine)}
    assert remove_stale_scratch(str(tmp_path / "missing")) == []


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


KILL_RUN = LLAMA + ["--train-iters", "4", "--log-interval", "1", "--eval-interval", "0",
                    "--no-tensorboard", "--peak-tflops", "1", "--global-batch-size", "4",
                    "--data-parallel-sharding-strategy", "optim_grads",
                    "--optimizer-offload-device", "nvme", "--ddp-bucket-size", "20000",
                    "--save-interval", "2"]


def test_kill_mid_step_then_resume_cleans_scratch(tmp_path, corpus_env):
    """Rank 0 is SIGKILLed inside optimizer step 3, after its first NVMe shard was
    rewritten; the checkpoint of iteration 2 loads, the killed run's scratch folders are
    removed at the next start, and the resumed run leaves none."""
    from launch import run_train, train_losses

    off, save = tmp_path / "offload", tmp_path / "save"
    args = KILL_RUN + ["--offload-path", str(off), "--save", str(save), "--load", str(save)]
    first = run_train(2, args, tmp_path / "log1", check=False,
                      env={**corpus_env, "SHARDZOO_TEST_KILL_IN_OFFLOAD_STEP": "0:3"})
    assert first.returncode != 0
    left = [n for n in os.listdir(off) if n.startswith(PREFIX)]
    assert any(".rank0." in n for n in left), left  # the killed rank's scratch stayed
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    second = run_train(2, args, tmp_path / "log2", env=corpus_env)
    assert "at iteration 2" in second.stdout, second.stdout[-3000:]
    losses = train_losses(tmp_path / "log2")
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    # the killed run's folders went at the second start (a run removes only its own at exit)
    assert os.listdir(off) == []


_TRIM = """
import torch
from parallel_state.host_memory import tune_host_allocator
from training.offload import release_freed_host_memory

def rss():
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS")) * 1024

assert tune_host_allocator()
xs = [torch.ones(5_000_000) for _ in range(20)]  # 400 MB in 20 MB blocks, kept when freed
before = rss()
del xs
kept = rss()
assert release_freed_host_memory()
print(before, kept, rss())
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc (Linux)")
def test_offload_run_returns_freed_build_memory():
    """With train.py's tuned allocator freed blocks stay resident (a ZeRO-3 build's full copy
    of the model would); the trim an offload run does after the build gives them back."""
    import sys

    from launch import REPO

    out = subprocess.run([sys.executable, "-c", _TRIM], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, kept, after = map(int, out.stdout.split())
    assert kept > before - 100e6  # the tuned allocator kept (nearly) all 400 MB
    assert after < kept - 300e6  # the trim returned them
