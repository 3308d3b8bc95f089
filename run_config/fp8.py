"""Checks of the FP8 flags (layers/fp8.py): values, the layouts whose tiles or blocks a
tensor-parallel split would cut, and what FP8 is not built with, refused with `ConfigError`
before any process-group work (called from run_config/checks.py)."""
from __future__ import annotations

import math

from layers.fp8 import Fp8Recipe
from models.config import ConfigError, ModelConfig

from .train_config import TrainConfig

_DEFAULTS = TrainConfig()
_RECIPE_FLAGS = ("fp8_recipe", "fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo",
                 "first_last_layers_bf16")


def fp8_recipe(t: TrainConfig) -> Fp8Recipe | None:
    """The run's `Fp8Recipe`, or None when --fp8-format is not given (FP8 off)."""
    if t.fp8_format is None:
        return None
    return Fp8Recipe(t.fp8_recipe, t.fp8_format, t.fp8_margin, t.fp8_amax_history_len,
                     t.fp8_amax_compute_algo)


def fp8_layers_kept(m: ModelConfig, t: TrainConfig) -> tuple[int, int]:
    """(first, last) transformer layers kept in the run's precision
    (--first-last-layers-bf16 with --num-layers-at-start-in-bf16 / --num-layers-at-end-in-bf16;
    (0, 0) without it)."""
    if not t.first_last_layers_bf16:
        return 0, 0
    return t.num_layers_at_start_in_bf16, t.num_layers_at_end_in_bf16


def check_fp8(m: ModelConfig, t: TrainConfig) -> None:
    """Raise `ConfigError` naming the flag and the fix."""
    if t.fp8_format is None:
        given = [n for n in _RECIPE_FLAGS if getattr(t, n) != getattr(_DEFAULTS, n)]
        if given:
            raise ConfigError(f"--{given[0].replace('_', '-')} sets up FP8 training, which "
                              f"--fp8-format turns on; add --fp8-format e4m3 or hybrid")
        return
    try:
        recipe = fp8_recipe(t)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    start, end = fp8_layers_kept(m, t)
    if start < 0 or end < 0:
        raise ConfigError(f"--num-layers-at-start-in-bf16 {start} / --num-layers-at-end-in-bf16 "
                          f"{end} must be >= 0")
    if m.is_encoder_decoder:
        raise ConfigError("--fp8-format is built for decoder-only models; drop it for "
                          "--model-type t5")
    if start + end >= m.num_layers:
        raise ConfigError(f"--first-last-layers-bf16 keeps {start} + {end} of the "
                          f"{m.num_layers} layers in higher precision, leaving none in FP8; "
                          f"lower --num-layers-at-start-in-bf16 / --num-layers-at-end-in-bf16")
    refused = [(t.compile, "--compile is not built with FP8; drop --compile"),
               (t.pipeline_schedule == "zb-h1", "--pipeline-schedule zb-h1 defers weight "
                "gradients, which the FP8 GEMMs compute in their backward; use 1f1b"),
               (t.lora_base_quantization != "none", "--lora-base-quantization holds the "
                "layer weights low-bit already; drop one of them")]
    for bad, why in refused:
        if bad:
            raise ConfigError(f"--fp8-format {t.fp8_format}: {why}")
    _check_tiles(m, t, recipe)
    _check_token_tiles(m, t, recipe)


def _check_token_tiles(m: ModelConfig, t: TrainConfig, recipe: Fp8Recipe) -> None:
    """blockwise / mxfp8 at cp > 1: the weight gradients' tiles run along the tokens (rows of
    `[s, b]`, position-major), so each of a CP rank's chunks (`s / 2cp` positions x b
    sequences) must hold whole tiles, or a tile would mix two chunks and its scale would
    differ from one process's."""
    cp, tile = t.context_parallel_size, recipe.tile
    if tile is None or cp == 1:
        return
    rows = m.seq_length // (2 * cp) * t.micro_batch_size
    if rows % tile:
        need = tile // math.gcd(tile, t.micro_batch_size) * 2 * cp
        raise ConfigError(
            f"--fp8-recipe {recipe.recipe} scales the weight gradients in tiles of {tile} "
            f"tokens; at --context-parallel-size {cp} a rank's chunk holds --seq-length "
            f"{m.seq_length} / {2 * cp} x --micro-batch-size {t.micro_batch_size} = {rows} "
            f"tokens, not a multiple of {tile}, so a tile would span two chunks; use a "
            f"--seq-length that is a multiple of {need} or --cp 1")


def _check_tiles(m: ModelConfig, t: TrainConfig, recipe: Fp8Recipe) -> None:
    """blockwise / mxfp8 at tp > 1: every tensor-parallel split dimension of a linear
    (a column layer's output rows per fused part, a row layer's input columns) must hold whole
    tiles on each rank, or a tile would mix two ranks' values and its scale would differ
    from one process's."""
    tp, tile = t.tensor_model_parallel_size, recipe.tile
    if tile is None or tp == 1:
        return
    gated = m.activation in ("swiglu", "geglu")
    groups = m.num_query_groups or m.num_attention_heads
    qkv = m.query_projection_size + 2 * m.kv_channels * groups
    split = {"QKV output (query groups' rows)": qkv, "attention output projection input "
             "(query projection size)": m.query_projection_size,
             f"MLP {'gate and up each' if gated else 'fc1 output'} / fc2 input "
             f"(--ffn-hidden-size)": m.ffn_hidden_size}
    bad = {k: v for k, v in split.items() if v % (tp * tile)}
    if bad:
        good = [d for d in range(2, 65) if all(v % (d * tile) == 0 for v in split.values())
                and groups % d == 0]
        fix = f"use --tensor-model-parallel-size in {good} or 1" if good else \
            "use --tensor-model-parallel-size 1"
        raise ConfigError(
            f"--fp8-recipe {recipe.recipe} scales tiles of {tile} along each GEMM's "
            f"contraction dimension; at tp {tp} a rank's share of "
            + ", ".join(f"{k} = {v} / {tp}" for k, v in bad.items())
            + f" is not a multiple of {tile}, so a tile would span two ranks; {fix}")
