"""Per-iteration metrics: one stdout line, one JSON object in `<log-dir>/metrics.jsonl`, and
TensorBoard scalars in `<log-dir>` when `tensorboard` is installed. Only global rank 0 writes.
"""
from __future__ import annotations

import json
import os
import resource
import time

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: CUDA max allocated bytes, or peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class MetricsLogger:
    """Writes metrics on global rank 0; other ranks get a no-op logger."""

    def __init__(self, log_dir: str | None, *, enabled: bool, tensorboard: bool = True):
        self.enabled = enabled and log_dir is not None
        self.start = time.time()
        self.writer = None
        self.jsonl = None
        if not self.enabled:
            return
        os.makedirs(log_dir, exist_ok=True)
        self.jsonl = open(os.path.join(log_dir, "metrics.jsonl"), "a", buffering=1)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard not installed: metrics.jsonl only
                SummaryWriter = None
            if SummaryWriter is not None:
                self.writer = SummaryWriter(log_dir=log_dir)

    def log(self, record: dict, line: str | None = None, prefix: str = "train") -> None:
        if not self.enabled:
            return
        if line:
            print(line, flush=True)
        self.jsonl.write(json.dumps(record) + "\n")
        if self.writer is not None:
            step = record.get("iteration", 0)
            for k, v in record.items():
                if k != "iteration" and isinstance(v, (int, float)) and v is not None:
                    self.writer.add_scalar(f"{prefix}/{k}", v, step)

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.writer is not None:
            self.writer.close()
