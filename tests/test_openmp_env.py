"""OpenMP's wait policy (run_config/openmp_env.py): the entry points set libgomp's variables
before torch (and so libgomp) is loaded, and only when the user set neither; off Linux
nothing is set."""
import os
import subprocess
import sys

import pytest

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
