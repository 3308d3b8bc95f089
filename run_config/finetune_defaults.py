"""Defaults of a fine-tune: `train.py --load CKPT --finetune` with settings nobody gave.

TrainConfig's defaults are a pretraining run's (Megatron's): lr 3e-4 decaying to 0 with no
warm-up, a global batch of one sequence per data-parallel rank, validation every 1000
iterations over 100 batches, logs in runs/latest. For a fine-tune of a loaded model, each
setting that neither the run file nor a flag gives is taken from the common fine-tuning
practice of HF Trainer and Megatron's SFT recipes instead:

- ``lr`` 2e-5 (fine-tuning rates are 1e-5..5e-5; 3e-4 moves a pretrained model far), decaying
  (cosine) to ``min_lr`` = lr / 10;
- ``lr_warmup_iters``: 3% of ``train_iters`` (HF's usual ``warmup_ratio``, Megatron's
  ``--lr-warmup-fraction``), at least 2: the AdamW moments start fresh and the first step
  should not take the full rate;
- ``global_batch_size`` 16 sequences, rounded up to a multiple of micro batch x dp (x pp for
  the interleaved schedule) at `resolve_global_batch`, since dp is known only there;
- ``eval_interval``: a quarter of the run (validation at the start and up to 4 more times:
  training/metrics.py `validates_at`), over
  ``eval_iters`` = interval / 10 batches: a forward costs a third of a training step, so
  validation takes about 3% of the run's compute, whatever its length;
- ``log_dir`` runs/<name of --save> (else runs/<name of --load>-finetune), so the run's
  metrics neither mix with another run's in runs/latest nor supersede them.

`finetune_defaults` picks them; `describe` is the start-up line that says them.
"""
from __future__ import annotations

import math
import os

LR = 2e-5
GLOBAL_BATCH = 16
WARMUP_SHARE, MIN_WARMUP = 0.03, 2
VALIDATIONS = 4  # after the one at the start
EVAL_SHARE = 10  # eval_iters = eval_interval / this


def _run_name(run: dict) -> str:
    for key, suffix in (("save", ""), ("load", "-finetune")):
        if run.get(key):
            return os.path.basename(os.path.normpath(run[key])) + suffix
    return "finetune"


def finetune_defaults(run: dict, train_iters: int) -> dict:
    """The fine-tune's values of the settings missing from `run` (the run file and flags,
    keyed by field name), for a run of `train_iters` iterations. `global_batch_size` is
    the target before rounding (see `resolve_global_batch`)."""
    lr = run.get("lr", LR)
    interval = run.get("eval_interval", max(1, math.ceil(train_iters / VALIDATIONS)))
    chosen = {"lr": LR, "min_lr": lr / 10,
              "lr_warmup_iters": min(train_iters, max(MIN_WARMUP,
                                                      math.ceil(WARMUP_SHARE * train_iters))),
              "global_batch_size": GLOBAL_BATCH, "eval_interval": interval,
              "eval_iters": max(1, round(interval / EVAL_SHARE)),
              "log_dir": os.path.join("runs", _run_name(run))}
    if run.get("train_samples"):  # the schedule counts samples; leave its warm-up alone
        del chosen["lr_warmup_iters"]
    return {k: v for k, v in chosen.items() if k not in run}


def resolve_global_batch(t, world_size: int) -> None:
    """Round the default global batch up to a multiple of what one step takes (micro batch x
    dp, x pp under the interleaved schedule); a layout train.py would refuse anyway (world
    not divisible by tp x pp) is left for its own error."""
    model_parallel = t.tensor_model_parallel_size * t.pipeline_model_parallel_size
    if world_size % model_parallel:
        return
    per_step = t.micro_batch_size * (world_size // model_parallel)
    vpp = t.virtual_pipeline_model_parallel_size
    if vpp is not None and vpp > 1:
        per_step *= t.pipeline_model_parallel_size
    t.global_batch_size = math.ceil(GLOBAL_BATCH / per_step) * per_step


def describe(defaults: dict, t) -> str:
    """The start-up line naming each default a fine-tune took (values as resolved in `t`)."""
    said = {"global_batch_size": f"global batch {t.global_batch_size}",
            "lr": f"lr {t.lr:g}", "min_lr": f"min lr {t.min_lr:g} (lr / 10)",
            "lr_warmup_iters": f"warm-up {t.lr_warmup_iters} iterations ({WARMUP_SHARE:.0%}, "
                               f"at least {MIN_WARMUP})",
            "eval_interval": f"validation every {t.eval_interval} iterations",
            "eval_iters": f"{t.eval_iters} batch{'es' if t.eval_iters != 1 else ''} each "
                          f"(~3% of the compute)",
            "log_dir": f"log dir {t.log_dir}"}
    flags = ", ".join("--" + k.replace("_", "-") for k in said if k in defaults)
    return (f"finetune defaults (not given): {', '.join(v for k, v in said.items() if k in defaults)}"
            f" (set with {flags})")
