"""Which weights a model is served with in low-bit form, checked before anything is loaded.

`LowBitPlan.of(config, src, quantization)` lists, from the model's shapes on the meta device
and the source's headers (`HFSource.weight_format`: the format and block size of each tensor
it returns as a `QuantizedWeight`, no data read), every parameter this rank's model will hold
quantized (layers/quantized.py): the source's low-bit linear weights (and a low-bit
embedding), or every linear weight `--quantization int8|int4` quantizes on load.
`check_low_bit_layout` then refuses, in one line, a tensor-parallel size whose split of a
row-parallel weight's input columns would cut a quantization block, naming the weight, the
block size and the tp values that keep every block whole; and an int4 group size that does
not divide a weight's input size.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

import parallel_state as ps
from layers.quant import FORMATS
from layers.quantized import Quantization, holds_quantized, weight_bytes
from layers.sharding import full_shape
from models.config import ConfigError


@dataclass(frozen=True)
class LowBitWeight:
    """One parameter held quantized: its format, block (input columns; None: whole rows,
    int8), dense input size, elements, and whether TP splits its input columns
    (`row_parallel`; `expert`: over the expert-tensor-parallel ranks)."""

    format: str
    block: int | None
    inputs: int
    elements: int
    row_parallel: bool
    expert: bool


@dataclass
class LowBitPlan:
    """`weights`: `{parameter name: LowBitWeight}` of the whole model (every stage)."""

    quantization: Quantization
    weights: dict[str, LowBitWeight] = field(default_factory=dict)

    @classmethod
    def of(cls, config, src, quantization: Quantization) -> "LowBitPlan":
        """The plan of HF source `src` (models/hf/files.py `HFSource`) loaded with
        `quantization` into `config`'s model on the current grid."""
        from models import model_class
        from models.hf import FAMILIES, rules_for

        plan = cls(quantization)
        if quantization.method == "none" or config.is_encoder_decoder:
            return plan
        fam = FAMILIES[src.config["model_type"]]
        spelled = {fam.normalize(n): n for n in src.names}
        sources = {r.native: r.hf for r in rules_for(config, src.config["model_type"])}
        with torch.device("meta"):
            model = model_class(config)(config, kv_replication=True)
        for name, p in model.named_parameters():
            module_name, _, _ = name.rpartition(".")
            linear, holds = holds_quantized(model.get_submodule(module_name))
            tied_copy = getattr(p, "shared_embedding", False) and name.startswith("output_")
            key = "embedding.word_embeddings.weight" if tied_copy else name
            expert = getattr(p, "expert_parallel", False)
            if expert:  # any one expert's tensors tell the format
                head, _, tail = key.rpartition(".experts.")
                key = f"{head}.experts.0.{tail}"
            stored = [src.weight_format(spelled[h]) for h in sources.get(key, ())
                      if h in spelled]
            stored = next((s for s in stored if s), None)
            if stored and holds:
                fmt, block = stored
            elif quantization.quantizes and linear and not tied_copy and not stored:
                fmt, block = quantization.method, quantization.block_size()
            else:
                continue
            shape = full_shape(p)
            plan.weights[name] = LowBitWeight(
                fmt, None if fmt == "int8" else block, shape[-1], int(torch.Size(shape).numel()),
                p.partition_dim == p.dim() - 1 and p.tensor_model_parallel and p.dim() > 1,
                expert)
        return plan

    def saved_bytes(self) -> int:
        """Bytes the low-bit weights spare against float32 (about: formats' bits per
        weight; int4 with float32 scales and zeros per group)."""
        total = 0
        for w in self.weights.values():
            bits = 8 + 32 / w.inputs if w.format == "int8" else \
                4 + 64 / w.block if w.format == "int4" else FORMATS[w.format].bits
            total += int(w.elements * (32 - bits) / 8)
        return total

    def cut(self, tp: int, expert_tp: int) -> tuple[str, LowBitWeight, int] | None:
        """The first weight whose input split over `tp` ranks (`expert_tp` for an expert's)
        cuts a block: `(name, weight, split)`; None when none does."""
        for name, w in self.weights.items():
            split = expert_tp if w.expert else tp
            if w.row_parallel and w.block and split > 1 and (
                    w.inputs % split or (w.inputs // split) % w.block):
                return name, w, split
        return None


def check_low_bit_layout(plan: LowBitPlan, tp_candidates: list[int]) -> None:
    """Refuse (`ConfigError`, one line) the current grid's tp when it cuts a block of a
    low-bit weight (`LowBitPlan.cut`), naming the weight, the block and which of
    `tp_candidates` (the tp values the heads split over) keep every block whole; and an int4
    group size that does not divide a weight's input size."""
    q = plan.quantization
    for name, w in plan.weights.items():
        if w.format == q.method == "int4" and w.inputs % w.block:
            fits = [g for g in (32, 64, 128) if w.inputs % g == 0]
            raise ConfigError(
                f"--quantization int4 with groups of {w.block} cannot quantize {name} (input "
                f"size {w.inputs}); use --quantization-group-size "
                f"{' or '.join(map(str, fits))}" if fits else
                f"--quantization int4 cannot quantize {name}: its input size {w.inputs} is "
                f"not a multiple of 32; use --quantization int8")
    tp = ps.get_tensor_model_parallel_world_size()
    ep = ps.get_expert_model_parallel_world_size() > 1
    found = plan.cut(tp, 1 if ep else tp)
    if found is None:
        return
    name, w, split = found
    good = [t for t in tp_candidates if plan.cut(t, 1 if ep else t) is None]
    raise ConfigError(
        f"--tp {tp} would cut the {w.format} blocks of {w.block} input columns of {name} "
        f"({w.inputs} inputs, {w.inputs / split:g} per rank); use --tp "
        f"{', '.join(map(str, good))}" + (", or --quantization none" if w.format not in (
            "int8", "int4") else ", or another --quantization-group-size"))


def weight_bytes_line(model) -> str:
    """The start-up line of this rank's weight bytes (layers/quantized.py `weight_bytes`)."""
    quantized, float_bytes, float32 = weight_bytes(model)
    mib = 2**20
    return (f"weights on this rank: {(quantized + float_bytes) / mib:,.1f} MiB "
            f"({quantized / mib:,.1f} MiB low-bit + {float_bytes / mib:,.1f} MiB float; "
            f"{float32 / mib:,.1f} MiB in float32)")
