"""How a parallel layer holds a low-bit weight (layers/quant `QuantizedWeight`) for inference.

A `ColumnParallelLinear` / `RowParallelLinear` (the tied output layer included), an MoE
`GroupedLinear` and a `VocabParallelEmbedding` hold either their float `nn.Parameter` or, after
`install`, a `QuantizedWeight` (an MoE layer: `QuantizedExperts`, one per local expert) under
the same attribute name. The layers never look at the format: `layers.linear.linear` sends a
quantized weight to `QuantizedWeight.linear`, the experts' loop multiplies `weight[e]` through
the same function, and an embedding looks its rows up with `embedding_rows`
(`QuantizedWeight.dequantize_rows`). A quantized weight is not a parameter: it has no
gradient, `model.to(dtype)` leaves it as it is, and training refuses it
(`refuse_quantized`). The sharding attributes of the parameter it replaces
(layers/sharding.py) are copied onto it, so `shard_tensor` / `full_shape` read them alike.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .quant import INT4_GROUP_SIZES, QuantizedWeight

# the sharding attributes (layers/sharding.py) a quantized weight keeps from its parameter
SHARDING_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "num_fused_parts",
                       "sequence_parallel", "full_rows", "init_key", "shared_embedding",
                       "expert_parallel", "kv_replicas", "qkv_layout")


def is_quantized(weight) -> bool:
    """Whether `weight` is a low-bit weight (`QuantizedWeight` or `QuantizedExperts`)."""
    return isinstance(weight, (QuantizedWeight, QuantizedExperts))


class QuantizedExperts:
    """The stacked weight `[experts, out, in]` of an MoE layer's local experts held as one
    `QuantizedWeight` `[out, in]` per expert: `weight[e]` is expert e's, `shape` the stacked
    shape, as `GroupedLinear` reads a float stacked weight."""

    requires_grad = False

    def __init__(self, experts: list[QuantizedWeight]):
        if not experts or len({(w.format, tuple(w.shape)) for w in experts}) != 1:
            raise ValueError("an MoE layer's quantized experts need one format and shape each")
        self.experts = list(experts)
        self.shape = torch.Size((len(experts), *experts[0].shape))

    def __getitem__(self, e: int) -> QuantizedWeight:
        return self.experts[e]

    def __len__(self) -> int:
        return len(self.experts)

    @property
    def format(self) -> str:
        return self.experts[0].format

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.experts)

    def __repr__(self) -> str:
        return f"QuantizedExperts({len(self.experts)} x {self.experts[0]!r})"


def install(module: nn.Module, name: str, weight) -> None:
    """Replace `module`'s parameter `name` by the quantized `weight` (this rank's shard),
    which takes over the parameter's sharding attributes. Raises ValueError when the shapes
    differ (naming both)."""
    param = module._parameters.get(name)
    if param is None:
        raise ValueError(f"{type(module).__name__} has no parameter {name!r} to quantize")
    if tuple(weight.shape) != tuple(param.shape):
        raise ValueError(f"quantized weight {tuple(weight.shape)} does not fit parameter "
                         f"{name} {tuple(param.shape)}")
    for attr in SHARDING_ATTRIBUTES:
        if hasattr(param, attr):
            setattr(weight, attr, getattr(param, attr))
    del module._parameters[name]
    object.__setattr__(module, name, weight)


def quantized_weights(model: nn.Module):
    """`(name, weight)` of every quantized weight `model` holds (`install`)."""
    for prefix, module in model.named_modules():
        for attr in ("weight",):
            w = module.__dict__.get(attr)
            if is_quantized(w):
                yield (f"{prefix}.{attr}" if prefix else attr), w


def zero_rows(like: QuantizedWeight, rows: int) -> QuantizedWeight:
    """A `[rows, in]` weight of `like`'s format and block size whose values are all 0 (every
    format's all-zero storage is: scales / deltas 0): the vocabulary padding rows."""
    return QuantizedWeight(like.format, (rows, like.shape[1]),
                           {k: v.new_zeros((rows, *v.shape[1:])) for k, v in like.tensors.items()})


def embedding_rows(ids: torch.Tensor, weight, dtype: torch.dtype) -> torch.Tensor:
    """`F.embedding(ids, weight)`: `ids [...]` -> `[..., h]`; a quantized table de-quantizes
    only the rows `ids` names (in `dtype`, the model's float dtype)."""
    if isinstance(weight, QuantizedWeight):
        flat = weight.dequantize_rows(ids.reshape(-1).long())
        return flat.to(dtype).view(*ids.shape, weight.shape[1])
    return F.embedding(ids, weight)


def weight_bytes(model: nn.Module) -> tuple[int, int, int]:
    """`(quantized bytes, float bytes, float32 bytes)` of this rank's weights: the storage of
    its quantized weights, its float parameters as held, and what all of them would take in
    float32 (the dense-in-float32 comparison of the start-up line)."""
    quantized = float_bytes = elements = 0
    for _, w in quantized_weights(model):
        quantized += w.nbytes
        elements += w.shape.numel()
    seen = set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            float_bytes += p.numel() * p.element_size()
            elements += p.numel()
    return quantized, float_bytes, 4 * elements


def refuse_quantized(model: nn.Module, what: str) -> None:
    """Raise ValueError when `model` holds quantized weights (`what`: the action, e.g.
    "saving a training checkpoint"): they are inference-only."""
    found = next(iter(quantized_weights(model)), None)
    if found is not None:
        raise ValueError(f"{what} of a model with low-bit weights ({found[0]} is "
                         f"{found[1].format}) is not supported: quantized weights are for "
                         f"inference; load the float model")


QUANTIZATION_METHODS = ("none", "int8", "int4")
# float32 bytes of a weight's rows quantized at a time on load (`Quantization.quantize`)
QUANTIZE_SLAB = 16 * 2**20


@dataclass(frozen=True)
class Quantization:
    """What loading does with the weights (infer.py `--quantization`, vLLM's and Megatron's
    flag name): `method` None keeps the file's form (a GGUF's blocks stay packed, a float
    checkpoint stays float); "none" de-quantizes every low-bit weight to float; "int8"
    (per output channel, symmetric) or "int4" (groups of `group_size` input columns,
    `symmetric` or with a zero point) quantizes every float linear weight of the
    transformer layers and the output layer on load by round-to-nearest (layers/quant
    formats.quantize). Embeddings, norms and routers stay float; a tied output layer is the
    embedding, so it stays float too unless the file holds it quantized."""

    method: str | None = None
    group_size: int = 128
    symmetric: bool = True

    def __post_init__(self):
        if self.method is not None and self.method not in QUANTIZATION_METHODS:
            raise ValueError(f"--quantization {self.method} is not supported; use one of "
                             f"{', '.join(QUANTIZATION_METHODS)}")
        if self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"--quantization-group-size {self.group_size} is not supported; "
                             f"use one of {', '.join(map(str, INT4_GROUP_SIZES))}")

    @property
    def quantizes(self) -> bool:
        """Whether float weights are quantized on load."""
        return self.method in ("int8", "int4")

    def block_size(self) -> int | None:
        """Input columns per block of the weights it makes (int8: None, whole rows)."""
        return self.group_size if self.method == "int4" else None

    def describe(self) -> str:
        if self.method == "int4":
            return (f"int4, groups of {self.group_size}, "
                    f"{'symmetric' if self.symmetric else 'asymmetric'}")
        return self.method or "as stored"

    def prepare(self, value, linear: bool, holds: bool):
        """The form parameter-to-be `value` (a float tensor or a `QuantizedWeight`, dense)
        is held in: `linear` says the parameter is a linear weight this quantizes (a column-
        or row-parallel layer's or an expert's, not a tied embedding), `holds` that its layer
        can hold a low-bit weight at all (those, and a vocabulary embedding). A low-bit value
        its layer cannot hold, or with method "none", is de-quantized to float32."""
        if isinstance(value, QuantizedWeight):
            if self.quantizes:
                raise ValueError(f"--quantization {self.method} quantizes float weights, but "
                                 f"this file's are already {value.format}; drop "
                                 f"--quantization to keep them, or pass --quantization none")
            if self.method == "none" or not holds:
                return value.dequantize(torch.float32)
            return value
        if self.quantizes and linear:
            return self.quantize(value)
        return value

    def quantize(self, weight: torch.Tensor) -> QuantizedWeight:
        """`QuantizedWeight.quantize` of float `[out, in]` `weight`, `QUANTIZE_SLAB` float32
        bytes of rows at a time (every format quantizes rows independently): round-to-
        nearest's float temporaries stay a few slabs, not a few copies of the weight."""
        rows = max(1, QUANTIZE_SLAB // (4 * weight.shape[1]))
        parts = [QuantizedWeight.quantize(weight[i:i + rows], self.method, self.group_size,
                                          self.symmetric)
                 for i in range(0, weight.shape[0], rows)]
        return parts[0] if len(parts) == 1 else QuantizedWeight.cat_rows(parts)


def holds_quantized(module: nn.Module) -> tuple[bool, bool]:
    """`(linear, holds)` of `Quantization.prepare` for the weight of `module`."""
    from .embedding import VocabParallelEmbedding
    from .linear import ColumnParallelLinear, RowParallelLinear
    from .moe.experts import GroupedLinear

    linear = isinstance(module, (ColumnParallelLinear, RowParallelLinear, GroupedLinear))
    return linear, linear or isinstance(module, VocabParallelEmbedding)


QLORA_GROUP_SIZE = 32  # int4 groups of a QLoRA base (q8_0 / q4_0 / q4_1 blocks are 32 too)


def quantize_layer_linears(model: nn.Module, fmt: str, group_size: int = QLORA_GROUP_SIZE,
                           symmetric: bool = True) -> int:
    """QLoRA's base (Dettmers et al. 2023, sec. 3): replace the weight of every column- and
    row-parallel linear inside `model`'s transformer layers (`...layers.<n>...`; not the
    embedding or output layer) by its round-to-nearest `fmt` form (`QuantizedWeight.quantize`,
    this rank's shard). The weights must be frozen (ValueError otherwise: a low-bit weight
    has no gradient); LoRA adapters under them (layers/lora.py) train, their input gradient
    passing through `QuantizedWeight.input_grad`. Returns the number of weights replaced."""
    from .linear import ColumnParallelLinear, RowParallelLinear

    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or \
                ".layers." not in f".{name}" or not isinstance(module.weight, nn.Parameter):
            continue
        if module.weight.requires_grad:
            raise ValueError(f"{name}.weight trains; only a frozen base (LoRA's) can be held "
                             f"low-bit")
        install(module, "weight", QuantizedWeight.quantize(module.weight.detach(), fmt,
                                                           group_size, symmetric))
        count += 1
    return count
