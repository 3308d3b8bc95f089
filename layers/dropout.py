"""Dropout whose masks do not depend on the layout (the default), or Megatron's per-rank streams.

Layout-independent masks ("sample" scheme, `--dropout-masks sample`). Whether element `e` of
a dropout site is kept is a pure function of

    (seed, global sample index, site, position in the sequence, feature or head/key index)

hashed with a counter-based integer mixer, in the spirit of counter-based generators such as
Philox (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3", sec. 2): no
generator state is consumed, so the mask of an element is the same whichever rank computes
it, at any TP / SP / PP / VPP / DP / ZeRO / recompute layout, and a resumed run draws the
masks the uninterrupted run would have drawn. The training schedules say which global samples
a microbatch holds (`parallel_state.dropout_sample_ids`); each module with dropout carries a
`dropout_site` (crc32 of its layout-independent module name, set by `assign_dropout_sites`),
so two layers never share masks. The site is a 0-dim int64 buffer (not persistent), not a
Python int: `torch.compile` then sees it as an input, and the layers share one compiled
graph instead of recompiling per layer.

- hidden dropout `[s, b, h]` (or its sequence-parallel shard `[s/tp, b, h]`): element
  `(pos, sample, j)` with `pos` the global position (the shard's offset added under SP);
- attention dropout on the probabilities `[b, n/tp, sq, sk]`: element `(sample, head, q, k)`
  with `head` the global query head (the TP rank's offset added).

Keep test: the 32-bit hash `v` keeps an element when `v >= round(p * 2^32)`, so the keep
probability is `1 - p` up to 2^-32; kept values are scaled by `1 / (1 - p)` (inverted dropout,
Srivastava et al. 2014, sec. 10). The hash is integer arithmetic on int64 tensors holding
32-bit values (every product stays below 2^63), identical on CPU and CUDA.

Without sample ids (a model called outside the training schedules, e.g. a user's own loop or
a layer test) or with `--dropout-masks rank-streams`, dropout draws from the RNG tracker's
streams as Megatron does: a replicated tensor from the default stream (the same on every TP
rank), a sharded one (heads, sequence shards) from the TP stream. Those masks depend on the
layout; nothing outside model code draws from either stream (parallel_state/random.py).
"""
from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F

import parallel_state as ps

MASK32 = 0xFFFFFFFF
# Odd multipliers below 2^31, so that `x * M` of a 32-bit `x` stays below 2^63 (no overflow
# in int64); the xor-shift-multiply rounds are those of Wellons' 32-bit "lowbias32" mixer.
_M1, _M2 = 0x7FEB352D, 0x5BD1E995
MIX32_MULTIPLIERS = (_M1, _M2)  # for C++ forms of `mix32` (inference/sampling_kernels.cpp)
# Sub-sites of one module (a transformer layer has three residual dropouts)
SITE_ATTENTION_RESIDUAL, SITE_CROSS_ATTENTION_RESIDUAL, SITE_MLP_RESIDUAL = 0, 1, 2


def mix32_int(x: int) -> int:
    """`mix32` of one Python int in [0, 2^32)."""
    x ^= x >> 16
    x = (x * _M1) & MASK32
    x ^= x >> 15
    x = (x * _M2) & MASK32
    return x ^ (x >> 16)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """Bijective 32-bit mixer, in place on an int64 tensor whose values are in [0, 2^32)."""
    x.bitwise_xor_(x >> 16).mul_(_M1).bitwise_and_(MASK32)
    x.bitwise_xor_(x >> 15).mul_(_M2).bitwise_and_(MASK32)
    return x.bitwise_xor_(x >> 16)


def site_id(name: str) -> int:
    """The dropout site of a module named `name` (32 bits)."""
    return zlib.crc32(name.encode())


def add_dropout_site(module: torch.nn.Module) -> None:
    """Give `module` its `dropout_site` buffer (0 until `assign_dropout_sites` names it)."""
    module.register_buffer("dropout_site", torch.zeros((), dtype=torch.int64), persistent=False)


def sub_site(site: torch.Tensor | int, k: int) -> torch.Tensor | int:
    """Site `k` of a module with several dropouts (a layer's residuals)."""
    return (site + k * 0x9E3779B9) & MASK32


def assign_dropout_sites(model: torch.nn.Module) -> None:
    """Set every `dropout_site` buffer of `model`'s submodules to the id of the submodule's
    name (`decoder.layers.7.self_attention`: global layer numbers, so the same at any
    pipeline layout). Call at the end of a model's constructor."""
    with torch.no_grad():
        for name, module in model.named_modules():
            site = module._buffers.get("dropout_site")
            if site is not None:
                site.fill_(site_id(name))


def _row_keys(sample_ids: torch.Tensor, site: torch.Tensor | int) -> torch.Tensor:
    """`[b]` int64 keys of (seed, site, sample) in [0, 2^32)."""
    ids = sample_ids.to(torch.int64)
    seed = mix32_int(ps.get_dropout_seed() & MASK32)
    base = mix32((torch.as_tensor(site, device=ids.device) & MASK32) ^ seed)
    keys = mix32((ids & MASK32).add_(base).bitwise_and_(MASK32))
    return mix32(keys.bitwise_xor_((ids >> 32) & MASK32))


def _keep(hashes: torch.Tensor, p: float) -> torch.Tensor:
    """The keep test of the module docstring: bool, True where `hashes >= round(p * 2^32)`."""
    return hashes >= round(p * 2.0 ** 32)


def apply_keep(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """`x` where `keep`, scaled by 1 / (1 - p) in the op's float32 arithmetic (a bf16 scale
    would be 1.109375 for p = 0.1, 0.16% low); backward keeps the 0/1 mask."""
    return (x * keep.to(x.dtype)).mul_(1.0 / (1.0 - p))


def _apply(x: torch.Tensor, hashes: torch.Tensor, p: float) -> torch.Tensor:
    return apply_keep(x, _keep(hashes, p), p)


def _counters(rows: torch.Tensor, cols: int, device, offset: int = 0,
              count: int | None = None) -> torch.Tensor:
    """Mixed counters `[len(rows), count]` of the elements `row * cols + col` for columns
    `offset .. offset + count` (default all `cols`)."""
    c = rows.to(device=device, dtype=torch.int64)[:, None] * cols
    cols_here = torch.arange(offset, offset + (cols if count is None else count), device=device)
    return mix32(c.add(cols_here).bitwise_and_(MASK32))


def hidden_dropout(x: torch.Tensor, p: float, training: bool, site: torch.Tensor | int,
                   sequence_parallel: bool = False,
                   positions: torch.Tensor | None = None) -> torch.Tensor:
    """Dropout on hidden states `x [s, b, h]`, or on the sequence shard `[s/tp, b, h]` of TP
    rank r (`sequence_parallel`: rows r*s/tp ... of the sequence). `positions` `[s * tp]` (or
    `[s]` without SP) int64: the global position of each row of the unsharded sequence, e.g.
    a context-parallel rank's load-balanced part (`layers.context_parallel.local_positions`),
    so its masks are those one process draws at those positions; default 0, 1, ... Returns
    `x` itself when `p == 0` or not `training`; masks as in the module docstring."""
    if p == 0.0 or not training:
        return x
    start = x.shape[0] * ps.get_tensor_model_parallel_rank() if sequence_parallel else 0
    return _keyed_dropout(x, p, site, start, positions, 0, x.shape[-1], sequence_parallel)


def feature_dropout(x: torch.Tensor, p: float, training: bool, site: torch.Tensor | int,
                    feature_offset: int = 0, num_features: int | None = None,
                    positions: torch.Tensor | None = None) -> torch.Tensor:
    """Dropout on `x [s, b, f]` holding features `feature_offset .. feature_offset + f` of a
    tensor `num_features` wide (default f): a row-parallel layer's input shard
    `[s, b, in/tp]` draws the masks of those columns of the whole `[s, b, in]` (a LoRA
    adapter's input; layers/lora.py). `positions` `[s]` int64 as in `hidden_dropout`. Without
    sample ids a feature shard draws from the TP stream, a whole tensor from the default one."""
    if p == 0.0 or not training:
        return x
    width = num_features or x.shape[-1]
    return _keyed_dropout(x, p, site, 0, positions, feature_offset, width,
                          width != x.shape[-1])


def _keyed_dropout(x: torch.Tensor, p: float, site, start: int, positions, feature_offset: int,
                   width: int, sharded: bool) -> torch.Tensor:
    """The sample-keyed masks of `x [s, b, f]`: rows `start ..` of `positions` (default the
    row numbers), columns `feature_offset ..` of a `width`-wide counter grid; stream
    dropout (`sharded` picks the stream) without sample ids."""
    ids = ps.get_dropout_sample_ids()
    if ids is None:
        return _stream_dropout(x, p, sharded=sharded)
    s, b, h = x.shape
    if ids.numel() != b:
        raise ValueError(f"dropout: {ids.numel()} sample ids for a batch of {b}")
    rows = torch.arange(start, start + s) if positions is None else \
        positions.to(torch.int64)[start: start + s]
    if rows.numel() != s:
        raise ValueError(f"dropout: {positions.numel()} positions do not cover the {s} rows "
                         f"of this {'sequence shard' if start else 'sequence'}")
    counters = _counters(rows, width, x.device, feature_offset, h)  # [s, h]
    keys = _row_keys(ids.to(x.device), site)
    return _apply(x, mix32(counters[:, None, :] ^ keys[None, :, None]), p)


def attention_dropout(probs: torch.Tensor, p: float, site: torch.Tensor | int,
                      query_positions: torch.Tensor | None = None,
                      key_positions: torch.Tensor | None = None,
                      num_keys: int | None = None) -> torch.Tensor:
    """Dropout on attention probabilities `[b, n/tp, sq, sk]` of this TP rank's query heads
    (global heads `rank * n/tp ...`), after the softmax. `p > 0`, training only.

    Element `(q, k)` is keyed as element `(query_positions[q], key_positions[k])` of a score
    matrix `num_keys` keys wide: `query_positions [sq]`, `key_positions [sk]` int64 global
    positions, e.g. a context-parallel rank's part of the sequence, whose masks then equal
    those one process draws for the whole sequence. Default (None): positions 0..sq-1 and
    0..sk-1, `num_keys = sk`. Positions need sample-keyed masks (raises ValueError without
    sample ids: stream masks cannot be addressed by position).
    """
    keys = attention_dropout_keys(probs.shape[1], site, probs.device)
    if keys is None:
        if query_positions is not None or key_positions is not None:
            raise ValueError("attention dropout at given positions needs layout-free masks "
                             "(--dropout-masks sample, inside the training schedules' "
                             "dropout_sample_ids)")
        return _stream_dropout(probs, p, sharded=True)  # heads are sharded over TP
    if keys.shape[0] != probs.shape[0]:
        raise ValueError(f"dropout: {keys.shape[0]} sample ids for a batch of {probs.shape[0]}")
    sq, sk = probs.shape[2:]
    q = torch.arange(sq) if query_positions is None else query_positions
    k = torch.arange(sk) if key_positions is None else key_positions
    return apply_keep(probs, attention_keep_mask(keys, p, q, k, num_keys or sk), p)


def attention_dropout_keys(n: int, site: torch.Tensor | int, device=None) -> torch.Tensor | None:
    """`[b, n]` int64 keys of (seed, site, sample, global query head) for this TP rank's `n`
    query heads, from the current sample ids (None without them: stream dropout). Computed
    once, they let a later call (a backward pass outside `dropout_sample_ids`) draw the same
    masks with `attention_keep_mask`."""
    ids = ps.get_dropout_sample_ids()
    if ids is None:
        return None
    heads = torch.arange(n, device=device) + n * ps.get_tensor_model_parallel_rank()
    keys = _row_keys(ids.to(device), site)[:, None] ^ mix32(heads + 0x9E3779B9)  # [b, n]
    return mix32(keys)


def attention_keep_mask(keys: torch.Tensor, p: float, query_positions: torch.Tensor,
                        key_positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Bool keep mask `[b, n, sq, sk]` of attention dropout: `keys [b, n]` from
    `attention_dropout_keys`, `query_positions [sq]` and `key_positions [sk]` int64 global
    positions in a score matrix `num_keys` wide (see `attention_dropout`)."""
    device = keys.device
    rows = query_positions.to(device=device, dtype=torch.int64)[:, None] * num_keys
    counters = mix32(rows.add(key_positions.to(device)).bitwise_and_(MASK32))  # [sq, sk]
    return _keep(mix32(counters[None, None] ^ keys[:, :, None, None]), p)


def sample_keyed() -> bool:
    """Whether attention dropout must run outside SDPA (masks keyed by sample, not a stream)."""
    return ps.get_dropout_sample_ids() is not None


def _stream_dropout(x: torch.Tensor, p: float, sharded: bool) -> torch.Tensor:
    """Megatron's scheme: the TP stream for a tensor sharded over TP ranks (heads or sequence),
    the tracker's default stream for a replicated one (the same masks on every TP rank)."""
    name = ps.MODEL_PARALLEL_RNG if sharded else ps.DEFAULT_RNG
    with ps.get_rng_tracker().fork(name):
        return F.dropout(x, p, True)
