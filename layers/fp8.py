"""FP8 training recipes for the column- and row-parallel linears' three GEMMs.

A linear layer `Y = X W^T` makes three GEMMs per step: forward `Y = X W^T` (`X [m, k]`,
`W [n, k]`), input gradient `dX = dY W` and weight gradient `dW = dY^T X`. Under FP8 each
operand is quantized to a float8 dtype with a scale, `q = sat(t * s)`, where `sat` rounds to
the nearest float8 value and clamps to the format's largest finite value, and the GEMM
multiplies the float8 values, undoing the scales on the float32 result. Master weights,
gradients, the optimizer, the embedding and the output layer stay in the run's precision
(float32 or bf16), as Transformer Engine and torchao do by default.

Formats (`--fp8-format`, Transformer Engine's names): `e4m3` everywhere (3 mantissa bits,
largest 448), or `hybrid`: e4m3 forward (`X`, `W`), e5m2 for the gradient `dY` (2 mantissa
bits, largest 57344). Scale from an amax (largest magnitude): `s = fmax / amax / 2^margin`
(`--fp8-margin`; an amax of 0 gives `s = 1`).

Recipes (`--fp8-recipe`), each operand scaled along the GEMM's contraction dimension:

- `tensorwise` (Transformer Engine's current scaling, torchao's tensorwise): one scale per
  tensor from its current amax; `X`, `W`, `dY` are scaled once and reused by both GEMMs
  they appear in.
- `delayed` (Transformer Engine's DelayedScaling): one scale per tensor from an amax history
  of `--fp8-amax-history-len` steps, `max` of it or its `most_recent` entry
  (`--fp8-amax-compute-algo`). Every step's amaxes (the largest over its microbatches) are
  reduced over all ranks and pushed into the history at the step's end
  (`update_amax_histories`), so the history is the same on every rank and at every layout;
  it is a persistent buffer (`fp8.amax_history`, `[history_len, 3]` for `X, W, dY`), saved
  in checkpoints. Values above the scaled range saturate. While a history holds no amax yet
  (a fresh run's first step) the current amax is used, as `tensorwise`.
- `rowwise` (torchao's rowwise): one scale per row of each GEMM operand in its
  contraction-major layout: rows of `X` and of `W` forward, rows of `dY` and columns of `W`
  for the input gradient, columns of `dY` and of `X` for the weight gradient.
- `blockwise` (DeepSeek-V3, Liu et al. 2024, sec. 3.3.2): activations and gradients in
  1x128 tiles along the contraction dimension (`X`, `dY` rows forward / input gradient; their
  columns, 128 tokens each, for the weight gradient), weights in 128x128 blocks (one
  quantization of `W` serves both GEMMs).
- `mxfp8` (OCP Microscaling v1.0): every operand in 1x32 tiles along the contraction
  dimension, each scale a power of two (E8M0), rounded so the tile's amax does not
  saturate (`amax_to_scale`).

Context parallelism: a rank holds 2 chunks of each sequence's tokens, so a per-tensor amax
of `X` or `dY`, and a rowwise weight-gradient amax (along the tokens), is reduced (max) over
the CP group as well; tiles along the tokens (blockwise, mxfp8 weight gradients) are a
chunk's own when a chunk's `s / 2cp x b` rows hold whole tiles (run_config/fp8.py refuses
the rest).

Tensor parallelism: a scale is the one a single process computes for the whole tensor. A
tensor-parallel shard's amax is reduced (max) over the TP group where the scale's group
crosses the split: per tensor for `tensorwise` (a column layer's `W` and `dY`, a row layer's
`X` and `W`), per row where the contraction dimension is split for `rowwise` (a column
layer's input gradient, a row layer's forward). A sequence-parallel input is gathered before
it is quantized. Tiles and blocks never cross a shard (run_config/fp8.py refuses layouts
that would cut one), so their scales are local.

Which GEMM runs where (`gemm_path`): `torch._scaled_mm` where it takes the scaling, i.e.
per-tensor and rowwise scales (on this CPU with torch 2.13 it takes both, float32 output;
on CUDA both need dimensions that are multiples of 16, rowwise a bf16 output);
an exact emulation elsewhere (tiles, blocks, MX): the same float8 values de-quantized
(`q / s`, float32) and multiplied in float32. Both give the product of the same float8
values, differing by float32 rounding only. `SHARDZOO_FP8_GEMM=emulate` forces the
emulation everywhere.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import parallel_state as ps
from parallel_state import collectives

RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise", "mxfp8")
FORMATS = ("e4m3", "hybrid")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
BLOCK = 128  # blockwise: activation tiles 1 x BLOCK, weight blocks BLOCK x BLOCK
MX_BLOCK = 32  # mxfp8 tiles 1 x MX_BLOCK
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
X, W, G = 0, 1, 2  # the operands: input, weight, output gradient (amax history columns)
ENV_SWITCH = "SHARDZOO_FP8_GEMM"


@dataclass(frozen=True)
class Fp8Recipe:
    """The FP8 settings of a run (Megatron's flags `--fp8-recipe`, `--fp8-format`,
    `--fp8-margin`, `--fp8-amax-history-len`, `--fp8-amax-compute-algo`). ValueError, naming
    the flag, for an unknown value."""

    recipe: str = "delayed"
    format: str = "hybrid"
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"

    def __post_init__(self):
        for flag, value, choices in (("--fp8-recipe", self.recipe, RECIPES),
                                     ("--fp8-format", self.format, FORMATS),
                                     ("--fp8-amax-compute-algo", self.amax_compute_algo,
                                      AMAX_COMPUTE_ALGOS)):
            if value not in choices:
                raise ValueError(f"{flag} {value!r}: expected one of {', '.join(choices)}")
        if self.amax_history_len < 1:
            raise ValueError(f"--fp8-amax-history-len must be >= 1, got {self.amax_history_len}")
        if self.margin < 0:
            raise ValueError(f"--fp8-margin must be >= 0, got {self.margin}")

    def dtype(self, role: int) -> torch.dtype:
        """The float8 dtype of operand `role` (X, W or G)."""
        return E5M2 if role == G and self.format == "hybrid" else E4M3

    @property
    def per_tensor(self) -> bool:
        return self.recipe in ("tensorwise", "delayed")

    @property
    def tile(self) -> int | None:
        """The tile length along the contraction dimension (blockwise, mxfp8), else None."""
        return {"blockwise": BLOCK, "mxfp8": MX_BLOCK}.get(self.recipe)


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of a float8 dtype (448 for e4m3, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


# ------------------------------------------------------------------ quantization
def _grouped(t: torch.Tensor, rows: int | None, cols: int | None) -> torch.Tensor:
    """`t [r, c]` zero-padded and viewed as `[r', rows, c', cols]` groups (None: the whole
    dimension is one group)."""
    r, c = t.shape
    rows, cols = rows or r, cols or c
    pr, pc = -r % rows, -c % cols
    if pr or pc:
        t = F.pad(t, (0, pc, 0, pr))
    return t.reshape((r + pr) // rows, rows, (c + pc) // cols, cols)


def group_amax(t: torch.Tensor, rows: int | None, cols: int | None) -> torch.Tensor:
    """The float32 amax of each `rows x cols` group of `t [r, c]` -> `[ceil(r/rows),
    ceil(c/cols)]` (None: the whole dimension; `(None, None)`: `[1, 1]`)."""
    return _grouped(t.detach().float(), rows, cols).abs().amax(dim=(1, 3))


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype, margin: int = 0,
                  power_of_two: bool = False) -> torch.Tensor:
    """Quantization scales `s` (`q = sat(t * s)`) from amaxes: `fmax / amax / 2^margin`, or
    with `power_of_two` (MX, E8M0 scales) `2^-ceil(log2(amax / fmax))`, the largest power of
    two that keeps `amax * s <= fmax` (the scale rounded up, as NVIDIA's MXFP8 does, rather
    than OCP's `floor(log2 amax) - emax`, which saturates amaxes in (448, 512) x 2^e). An
    amax of 0 (or not finite) gives 1."""
    amax = amax.float()
    ok = torch.isfinite(amax) & (amax > 0)
    safe = torch.where(ok, amax, torch.ones_like(amax))
    if power_of_two:
        scale = torch.exp2(-torch.ceil(torch.log2(safe / fp8_max(dtype))))
    else:
        scale = fp8_max(dtype) / safe / (2.0 ** margin)
    return torch.where(ok, scale, torch.ones_like(scale))


def quantize(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rows: int | None,
             cols: int | None) -> torch.Tensor:
    """`sat(t * s)` in `dtype`: `t [r, c]`, `scale [r', c']` one per `rows x cols` group
    (`group_amax`'s grid) -> float8 `[r, c]`, rounded to nearest, clamped to +-fmax."""
    r, c = t.shape
    g = _grouped(t.float(), rows, cols) * scale[:, None, :, None]
    limit = fp8_max(dtype)
    q = g.clamp_(-limit, limit).to(dtype)
    return q.reshape(g.shape[0] * g.shape[1], -1)[:r, :c]


def dequantize(q: torch.Tensor, scale: torch.Tensor, rows: int | None, cols: int | None
               ) -> torch.Tensor:
    """float32 `q / s` of `quantize`'s result."""
    r, c = q.shape
    g = _grouped(q.float(), rows, cols) / scale[:, None, :, None]
    return g.reshape(g.shape[0] * g.shape[1], -1)[:r, :c]


@dataclass
class Operand:
    """One GEMM operand `[rows, k]` (k: the contraction dimension) in float8: its values, its
    scales (`[r', c']` on the `rows x cols` grid) and that grid."""

    q: torch.Tensor
    scale: torch.Tensor
    rows: int | None
    cols: int | None

    def t(self) -> "Operand":
        """The transposed operand (the same float8 values and scales)."""
        return Operand(self.q.t(), self.scale.t(), self.cols, self.rows)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.q, self.scale, self.rows, self.cols)


def make_operand(t: torch.Tensor, dtype: torch.dtype, rows: int | None, cols: int | None,
                 margin: int = 0, power_of_two: bool = False, group=None) -> Operand:
    """Quantize `t [r, k]` with scales from its current amax on the `rows x cols` grid;
    `group`: the process group (or a tuple of groups, reduced one after the other) whose
    shards' amaxes are reduced (max) first, or None."""
    amax = group_amax(t, rows, cols)
    for g in group if isinstance(group, tuple) else (group,):
        if g is not None:
            collectives.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=g)
    scale = amax_to_scale(amax, dtype, margin, power_of_two)
    return Operand(quantize(t, scale, dtype, rows, cols), scale, rows, cols)


# ------------------------------------------------------------------ the GEMM
def _forced_emulation() -> bool:
    choice = os.environ.get(ENV_SWITCH, "auto").strip().lower()
    if choice not in ("auto", "emulate"):
        raise ValueError(f"{ENV_SWITCH}={choice!r}: expected auto (torch._scaled_mm where it "
                         f"takes the scaling) or emulate")
    return choice == "emulate"


def gemm_path(a: Operand, b: Operand) -> str:
    """'scaled_mm' where `torch._scaled_mm` takes the operands' scaling (both per tensor, or
    both one scale per row: a's rows and b's rows, b transposed; on CUDA with dimensions that
    are multiples of 16), else 'emulate'."""
    if _forced_emulation():
        return "emulate"
    per_tensor = a.scale.numel() == 1 and b.scale.numel() == 1
    rowwise = a.cols is None and b.cols is None and a.rows == 1 and b.rows == 1
    if not (per_tensor or rowwise):
        return "emulate"
    if a.q.device.type == "cuda" and any(d % 16 for d in (*a.q.shape, b.q.shape[0])):
        return "emulate"
    return "scaled_mm" if a.q.device.type in ("cpu", "cuda") else "emulate"


def scaled_gemm(a: Operand, b: Operand) -> torch.Tensor:
    """`a @ b^T` of two float8 operands (`a [m, k]`, `b [n, k]`) with their scales undone:
    float32 `[m, n]`, through `gemm_path`'s choice."""
    if gemm_path(a, b) == "emulate":
        return a.dequantize() @ b.dequantize().t()
    qa = a.q.contiguous()
    qb = b.q.contiguous().t()  # column-major, as _scaled_mm wants its second operand
    if a.scale.numel() == 1 and b.scale.numel() == 1:
        sa, sb = (1.0 / a.scale).reshape(()), (1.0 / b.scale).reshape(())
        out = torch.float32
    else:
        sa = (1.0 / a.scale).reshape(-1, 1).contiguous()
        sb = (1.0 / b.scale).reshape(1, -1).contiguous()
        out = torch.bfloat16 if qa.device.type == "cuda" else torch.float32
    return torch._scaled_mm(qa, qb, scale_a=sa, scale_b=sb, out_dtype=out).float()


# ------------------------------------------------------------------ per-layer state
class Fp8State(nn.Module):
    """A parallel linear layer's FP8 recipe and, under `delayed`, its amax history.

    `parallel`: "column" or "row" (ColumnParallelLinear / RowParallelLinear), which says
    which operands are TP shards: a column layer's weight rows and gradient columns, a row
    layer's input and weight columns (the contraction dimension of its forward). Buffers
    (delayed only): `amax_history [history_len, 3]` (persistent: saved in checkpoints),
    row 0 the latest step's amaxes of X, W, dY, and the step's running amaxes (not saved)."""

    def __init__(self, recipe: Fp8Recipe, parallel: str):
        super().__init__()
        if parallel not in ("column", "row"):
            raise ValueError(f"parallel must be column or row, got {parallel!r}")
        self.recipe, self.parallel = recipe, parallel
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.cp = ps.get_context_parallel_world_size()
        if recipe.recipe == "delayed":
            self.register_buffer("amax_history",
                                 torch.zeros(recipe.amax_history_len, 3, dtype=torch.float32))
            self.register_buffer("step_amax", torch.zeros(3, dtype=torch.float32),
                                 persistent=False)

    def _tp_group(self, needed: bool):
        return ps.get_tensor_model_parallel_group() if needed and self.tp > 1 else None

    def _groups(self, tp_split: bool, token_split: bool) -> tuple:
        """The groups an amax is reduced over: TP where its scale's group crosses the TP
        split, CP where it spans tokens (a CP rank holds part of each sequence)."""
        cp = ps.get_context_parallel_group() if token_split and self.cp > 1 else None
        return self._tp_group(tp_split), cp

    def split(self, role: int, transposed: bool = False) -> tuple[bool, bool]:
        """(rows split, columns split) over TP of operand `role` as `[rows, k]` forward
        layout (X `[m, k]`, W `[n, k]`, dY `[m, n]`), swapped when `transposed`."""
        if self.tp == 1:
            return False, False
        col = self.parallel == "column"
        out = {X: (False, not col), W: (col, not col), G: (False, col)}[role]
        return out[::-1] if transposed else out

    def per_tensor(self, role: int, t: torch.Tensor, record: bool) -> Operand:
        """`t` (operand `role`, forward layout) scaled per tensor: its current amax
        (tensorwise, and delayed while its history is empty) or the history's (delayed); the
        current local amax is kept for the step's history update when `record`."""
        r, dtype = self.recipe, self.recipe.dtype(role)
        group = self._groups(any(self.split(role)), role != W)
        if r.recipe == "delayed":
            amax = group_amax(t, None, None)
            if record:
                self.step_amax[role] = torch.maximum(self.step_amax[role], amax.reshape(()))
            hist = self.amax_history[:, role]
            if bool(hist.max() > 0):
                past = hist.max() if r.amax_compute_algo == "max" else hist[0]
                scale = amax_to_scale(past.reshape(1, 1), dtype, r.margin)
                return Operand(quantize(t, scale, dtype, None, None), scale, None, None)
        return make_operand(t, dtype, None, None, r.margin, group=group)

    def along_k(self, role: int, t: torch.Tensor, transposed: bool = False,
                weight_block: bool = False) -> Operand:
        """`t [rows, k]` (operand `role`, `transposed` from its forward layout) scaled along
        its contraction dimension k: per row (rowwise; amaxes reduced over TP when k is
        split), in 1 x tile tiles (blockwise, mxfp8) or, `weight_block`, tile x tile blocks."""
        r, dtype = self.recipe, self.recipe.dtype(role)
        if r.recipe == "rowwise":  # k is the tokens for X and dY transposed (weight gradient)
            return make_operand(t, dtype, 1, None, r.margin,
                                group=self._groups(self.split(role, transposed)[1],
                                                   role != W and transposed))
        rows = r.tile if weight_block else 1
        return make_operand(t, dtype, rows, r.tile, r.margin,
                            power_of_two=r.recipe == "mxfp8")

    def extra_repr(self) -> str:
        r = self.recipe
        return f"recipe={r.recipe}, format={r.format}, parallel={self.parallel}"


class _Fp8Linear(torch.autograd.Function):
    """`Y = X W^T + b` with the three GEMMs in FP8 (the module docstring's recipes): `x
    [..., k]` (a sequence-parallel input already gathered), `weight [n, k]` -> `[..., n]`
    in x's dtype; gradients in the dtypes of x and the weight. Saves x and the weight (the
    backward re-quantizes them along its GEMMs' contraction dimensions; per-tensor scales
    are kept from the forward)."""

    @staticmethod
    def forward(ctx, x, weight, bias, state: Fp8State, record: bool):
        r = state.recipe
        x2 = x.reshape(-1, x.shape[-1])
        if r.per_tensor:
            qx, qw = state.per_tensor(X, x2, record), state.per_tensor(W, weight, record)
            ctx.scales = (qx.scale, qw.scale)
        elif r.recipe == "blockwise":
            qx, qw = state.along_k(X, x2), state.along_k(W, weight, weight_block=True)
        else:
            qx, qw = state.along_k(X, x2), state.along_k(W, weight)
        y = scaled_gemm(qx, qw)
        if bias is not None:
            y = y + bias.float()
        ctx.save_for_backward(x, weight)
        ctx.state, ctx.has_bias = state, bias is not None
        return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        state, r = ctx.state, ctx.state.recipe
        x2 = x.reshape(-1, x.shape[-1])
        g2 = grad.reshape(-1, grad.shape[-1])
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = grad_w = None
        if r.per_tensor:
            qg = state.per_tensor(G, g2, record=True)
            sx, sw = ctx.scales
            if need_x:  # dX = dY W
                qw = Operand(quantize(weight, sw, r.dtype(W), None, None), sw, None, None)
                grad_x = scaled_gemm(qg, qw.t())
            if need_w:  # dW = dY^T X
                qx = Operand(quantize(x2, sx, r.dtype(X), None, None), sx, None, None)
                grad_w = scaled_gemm(qg.t(), qx.t())
        else:
            if need_x:
                qg = state.along_k(G, g2)
                qw = state.along_k(W, weight, weight_block=True).t() \
                    if r.recipe == "blockwise" else state.along_k(W, weight.t(), True)
                grad_x = scaled_gemm(qg, qw)
            if need_w:
                grad_w = scaled_gemm(state.along_k(G, g2.t(), True),
                                     state.along_k(X, x2.t(), True))
        if grad_x is not None:
            grad_x = grad_x.to(x.dtype).view(x.shape)
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               state: Fp8State) -> torch.Tensor:
    """`x [..., k] @ weight[n, k]^T + bias` -> `[..., n]` in FP8 by `state`'s recipe (with
    autograd; `_Fp8Linear`). A forward with grad enabled (training) counts towards the
    step's amaxes under `delayed`; validation's (no-grad) does not."""
    return _Fp8Linear.apply(x, weight, bias, state, torch.is_grad_enabled())


# ------------------------------------------------------------------ model-wide
def apply_fp8(model: nn.Module, recipe: Fp8Recipe, num_layers: int,
              layers_at_start: int = 0, layers_at_end: int = 0) -> int:
    """Give the self-attention and dense-MLP linears of `model`'s transformer layers an
    `Fp8State` (their `fp8` attribute), except the first `layers_at_start` and last
    `layers_at_end` of the model's `num_layers` (global layer numbers;
    `--first-last-layers-bf16`). MoE layers, the embedding and the output layer keep the
    run's precision. Returns the number of linears in FP8."""
    from .linear import ColumnParallelLinear, RowParallelLinear
    from .mlp import MLP
    from .transformer import TransformerLayer

    count = 0
    for layer in model.modules():
        if not isinstance(layer, TransformerLayer):
            continue
        n = layer.layer_number
        if n < layers_at_start or n >= num_layers - layers_at_end:
            continue
        hosts = [layer.self_attention] + ([layer.mlp] if isinstance(layer.mlp, MLP) else [])
        for host in hosts:
            for m in host.modules():
                if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
                    m.fp8 = Fp8State(recipe, "column" if isinstance(m, ColumnParallelLinear)
                                     else "row")
                    count += 1
    return count


def fp8_states(chunks) -> list[tuple[str, Fp8State]]:
    """`[(module name, Fp8State)]` of this rank's chunks, names with global layer numbers."""
    return [(name, m) for chunk in chunks for name, m in chunk.named_modules()
            if isinstance(m, Fp8State)]


def fp8_state_bytes(chunks) -> int:
    """Bytes of this rank's FP8 state: every `Fp8State` buffer (under `delayed` the float32
    amax history `[history_len, 3]` and the step's amaxes `[3]` of each FP8 linear). The other
    recipes keep none (their scales are computed in each GEMM), and no recipe caches an FP8
    copy of a weight between GEMMs (each GEMM quantizes its operands afresh; those copies,
    1 byte per element plus scales, live only during the GEMM)."""
    return sum(b.numel() * b.element_size() for _, s in fp8_states(chunks)
               for b in s.buffers())


@torch.no_grad()
def clear_step_amaxes(chunks) -> None:
    """The start of a step under `delayed`: forget amaxes recorded outside training steps
    (start-up measurements run forward and backward passes), so a step's history entry is
    its own microbatches' only, whether the run started fresh or resumed."""
    for _, s in fp8_states(chunks):
        if hasattr(s, "step_amax"):
            s.step_amax.zero_()


@torch.no_grad()
def update_amax_histories(chunks) -> None:
    """The end of a step under `delayed`: every layer's running amaxes (X, W, dY, the largest
    over the step's microbatches) are reduced (max) over all ranks, so each history holds the
    amax of the whole tensor over the whole global batch, the same on every rank and at
    every layout, and pushed into the history (an amax that is not finite is not pushed:
    that operand's history stays as it was). Collective over the world: every rank calls it
    after each step's backward."""
    states = [(n, s) for n, s in fp8_states(chunks) if hasattr(s, "amax_history")]
    index = getattr(chunks[0], "fp8_amax_index", None)  # every rank's names -> row
    if index is None:
        names: list = [None] * torch.distributed.get_world_size() \
            if torch.distributed.is_initialized() else [None]
        local = sorted(n for n, _ in states)
        if torch.distributed.is_initialized():
            collectives.all_gather_object(names, local)
        else:
            names = [local]
        index = {n: i for i, n in enumerate(sorted({n for ns in names for n in ns}))}
        chunks[0].fp8_amax_index = index
    if not index:
        return
    device = states[0][1].amax_history.device if states else torch.device("cpu")
    amax = torch.zeros(len(index), 3, dtype=torch.float32, device=device)
    for name, s in states:
        amax[index[name]] = s.step_amax
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        collectives.all_reduce(amax, op=torch.distributed.ReduceOp.MAX)
    for name, s in states:
        new = amax[index[name]]
        ok = torch.isfinite(new)
        rolled = torch.roll(s.amax_history, 1, dims=0)
        rolled[0] = new
        s.amax_history.copy_(torch.where(ok, rolled, s.amax_history))
        s.step_amax.zero_()
