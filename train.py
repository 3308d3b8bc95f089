"""Pretrain a GPT / Llama-style model with data, tensor, sequence and pipeline parallelism.

    python train.py                                   # the demo (configs/demo.yaml), 1 process
    python train.py --config configs/tiny-llama.yaml --train-iters 50
    torchrun --nproc-per-node 4 train.py --config configs/tiny-llama.yaml --tp 2

With neither --config, --model nor --load the run file is configs/demo.yaml, the README's
main job (a 6.8M-parameter Llama-style model on the embedded corpus); any flag overrides its
keys. (`--load CKPT` alone takes the checkpoint's model and tokenizer instead.)
Config: a YAML file (--config) plus Megatron-named flags that override it; see docs/guide/configuration.md.

A configuration, checkpoint or data error prints one line (`train.py: configuration error:
...`) on rank 0 and exits with 2, 1 or 2 before any training step; a run stopped by
non-finite steps or by diverged replicas (`train.py: training error: ...`) exits with 3
without saving. Under torchrun the line is
also this worker's elastic error file (torch.distributed.elastic's JSON format), so torchrun's
failure summary shows it in place of "To enable traceback see ..."; any other exception is
recorded with its traceback by `torch.distributed.elastic.multiprocessing.errors.record`.
"""
import os
import sys
from pathlib import Path

from run_config.openmp_env import set_openmp_wait_defaults

set_openmp_wait_defaults()  # before torch loads libgomp (run_config/openmp_env.py)

from torch.distributed.elastic.multiprocessing.errors import record

from checkpoint.format import CheckpointError
from models.config import ConfigError
from parallel_state import say_error
from parallel_state.host_memory import tune_host_allocator
from training.arguments import parse_config
from training.trainer import DataError, NonFiniteError, ReplicaMismatchError, pretrain

DEMO = Path(__file__).resolve().parent / "configs" / "demo.yaml"


def with_demo_default(argv: list[str]) -> list[str]:
    """`argv` with `--config configs/demo.yaml` in front when it names no --config, --model
    or --load (which brings its checkpoint's model)."""
    named = any(a in ("--config", "--model", "--load") or
                a.startswith(("--config=", "--model=", "--load=")) for a in argv)
    return argv if named else ["--config", str(DEMO), *argv]


def _fail(kind: str, error: Exception, code: int) -> int:
    """Say `error` once (rank 0; every rank raised the same) and record it on every rank for
    torchrun, whichever rank it reports as the first failure."""
    say_error(f"train.py: {kind} error: {error}", int(os.environ.get("RANK", "0")))
    return code


@record
def main(argv=None) -> int:
    argv = with_demo_default(sys.argv[1:] if argv is None else list(argv))
    try:
        tune_host_allocator()  # large freed blocks stay in the process (host_memory.py)
    except ValueError as e:  # a bad SHARDZOO_HOST_MALLOC
        return _fail("configuration", e, 2)
    try:
        config = parse_config(argv)
        pretrain(config)
    except ConfigError as e:
        return _fail("configuration", e, 2)
    except CheckpointError as e:  # raised alike on every rank, before any training step
        return _fail("checkpoint", e, 1)
    except DataError as e:  # likewise
        return _fail("data", e, 2)
    except (NonFiniteError, ReplicaMismatchError) as e:  # alike on every rank; nothing saved
        return _fail("training", e, 3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
