"""Pretrain a GPT / Llama-style model with data, tensor, sequence (and pipeline) parallelism.

    python train.py                                   # demo: embedded stdlib corpus, 1 process
    torchrun --nproc-per-node 4 train.py --config configs/tiny-llama.yaml --tp 2

Config: a YAML file (--config) plus Megatron-named flags that override it; see README.md.
"""
import os
import sys

from models.config import ConfigError
from training.arguments import parse_config
from checkpoint.format import CheckpointError
from training.trainer import DataError, pretrain


def main(argv=None) -> int:
    try:
        config = parse_config(argv)
        pretrain(config)
    except ConfigError as e:
        if os.environ.get("RANK", "0") == "0":  # every rank sees the same error; say it once
            print(f"train.py: configuration error: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:  # raised alike on every rank, before any training step
        if os.environ.get("RANK", "0") == "0":
            print(f"train.py: checkpoint error: {e}", file=sys.stderr)
        return 1
    except DataError as e:  # likewise
        if os.environ.get("RANK", "0") == "0":
            print(f"train.py: data error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
