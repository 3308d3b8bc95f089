"""OpenMP's wait policy (run_config/openmp_env.py): the entry points set libgomp's variables
before torch (and so libgomp) is loaded, and only when the user set neither; off Linux
nothing is set."""
import os
import subprocess
import sys

import pytest
import torch

from run_config.openmp_env import SPIN_COUNT, WAIT_POLICY, set_openmp_wait_defaults

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_defaults_only_where_the_user_chose_nothing():
    env = {}
    assert set_openmp_wait_defaults(env, "linux") is True
    assert env == {"OMP_WAIT_POLICY": WAIT_POLICY, "GOMP_SPINCOUNT": SPIN_COUNT}
    for mine in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "0"}):
        env = dict(mine)
        assert set_openmp_wait_defaults(env, "linux") is False and env == mine
    env = {}
    assert set_openmp_wait_defaults(env, "darwin") is False and env == {}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="set on Linux only")
@pytest.mark.parametrize("entry", ["infer", "train"])
def test_entry_points_set_it_before_torch_loads(entry):
    """`-X importtime` lists modules in the order their imports finish: the setting's module
    comes before any of torch's, and the C environment libgomp reads holds the values."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = (f"import ctypes, {entry}, torch\n"
            "libc = ctypes.CDLL(None); libc.getenv.restype = ctypes.c_char_p\n"
            "print(libc.getenv(b'OMP_WAIT_POLICY').decode(), libc.getenv(b'GOMP_SPINCOUNT').decode())")
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", code], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [WAIT_POLICY, SPIN_COUNT]
    names = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()
             if line.startswith("import time:") and "|" in line]
    first_torch = next(i for i, n in enumerate(names) if n == "torch" or n.startswith("torch."))
    assert names.index("run_config.openmp_env") < first_torch


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _load_keeps_teams(ckpt: str) -> tuple[int, int, int]:
    """(threads before, after a checkpoint load, after one gather of a large object over the
    world group) of this rank with 2 intra-op threads: a gloo worker thread that copies more
    than 32K elements starts an OpenMP team of its own (one more thread), which would throttle
    libgomp's spinning for the whole process (parallel_state/collectives.py
    `in_transient_group`)."""
    import torch.distributed as dist

    from inference.loading import load

    torch.set_num_threads(2)
    torch.ones(1 << 20).add_(1)  # this thread's own team first
    before = _threads()
    load(load=ckpt)
    after = _threads()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, list(range(300_000)))  # the control: the world group
    return before, after, _threads()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_checkpoint_load_leaves_no_openmp_team_in_gloo_threads(tmp_path):
    """A native checkpoint loaded in a world of 1 and of 2 (tp 2) leaves the process with the
    threads it had: the load's gathers ran in a group of their own, ended with its threads;
    the same gather over the world group does add a team's thread (so the count can see it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from checkpoint.hf import import_hf
    from distributed import run_distributed

    hf, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    # 32 layers (290 tensors): DCP's pickled load plans pass gloo's 32K-element copy grain
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                 num_hidden_layers=32, num_attention_heads=2,
                                 num_key_value_heads=1, max_position_embeddings=64)
                     ).save_pretrained(hf)
    import_hf(hf, ckpt, log=lambda *a: None)
    for world in (1, 2):
        for before, after, control in run_distributed(_load_keeps_teams, world, ckpt, tp=world):
            assert after == before, (world, before, after)
            assert control > after, (world, after, control)
