"""A GGUF file's tensors as the file stores them: low-bit blocks kept, HF names and layout.

`read_gguf_tensors(path, meta, table, ranges, hf_config)` maps every tensor of a GGUF file
(its header read and its data ranges checked by models/hf/gguf_header.py) to the Hugging
Face state-dict entry transformers' `gguf_file=` reader would make of it, without
de-quantizing:

- a 2-D tensor of a block type layers/quant keeps (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) becomes a
  `QuantizedWeight` `[out, in]` over the file's bytes (a view of a private, copy-on-write
  memory map of the file: pages are read when used, never written back); F32 / F16 / BF16
  2-D tensors stay tensors of that dtype, views as well;
- rows that llama.cpp's converter reordered move whole (`index_select_rows`, a copy of that
  tensor only): the permutation is transformers' own (its `TENSOR_PROCESSORS`, e.g. the
  "llama" architecture's q/k rotate-half interleave), read off by running it on the row
  numbers `arange(out)`, so the two readers cannot disagree;
- a stacked MoE tensor `[experts, rows, in]` (`blk.N.ffn_gate_exps`, ...) becomes one
  weight per expert (`model.layers.N.mlp.experts.E.gate_proj.weight`), views again;
- 1-D tensors (norms, biases; a few KB each) are de-quantized to float32 by gguf's own
  `gguf.quants.dequantize` and transformed by transformers' processor exactly as its
  reader does (Gemma's `1 + w` norms, Qwen2-MoE's squeezed shared-expert gate).

HF names and shapes come from transformers' model of `hf_config` built on the meta device
(no memory) and saved layout (`revert_weight_conversion`: one tensor per expert), named in
GGUF by gguf's own `TensorNameMap`, as transformers' `get_gguf_hf_weights_map` does. So the
dict has the names, shapes and (de-quantized) values of the float32 dict
models/hf/files.py's de-quantizing path builds, tensor by tensor.

Everything is checked from the header before the file is mapped: every tensor's type is
kept (else one line naming the type, the tensor and `--quantization none`), has an HF name
and the HF shape; the data ranges were checked by `check_tensor_data` (exact sizes,
aligned, no overlap, inside the file).
"""
from __future__ import annotations

import mmap
import re

import numpy as np
import torch

from layers.quant import QuantizedWeight
from layers.quant.formats import BY_GGML_TYPE

from .gguf_header import TensorInfo, tensor_name_map
from .rules import HFConversionError

# GGUF architectures whose files keep their quantization here: the families models/hf
# imports from GGUF whose 2-D tensors are HF nn.Linear / nn.Embedding weights as stored
# (llama.cpp writes Mistral as "llama"). Not GPT-2 (HF's Conv1D weights are the transpose)
KEEPS_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "phi3", "gemma2",
                       "gemma3")
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_EXPERT = re.compile(r"(?P<head>.*\.experts)\.(?P<e>\d+)\.(?P<tail>[^.]+)$")
_NONE = "pass --quantization none to de-quantize the file to float32 as transformers does"


def hf_layout(hf_config) -> dict[str, torch.Size]:
    """`{HF tensor name: shape}` of transformers' model of `hf_config` in its saved layout
    (one tensor per expert), built on the meta device."""
    import copy

    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(hf_config))
    state = model.state_dict()
    try:  # transformers 5 fuses some tensors in memory (experts); back to the files' layout
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return {k: v.shape for k, v in state.items()}
    model._weight_conversions = None  # the architecture's own conversions
    return {k: v.shape for k, v in revert_weight_conversion(model, state).items()}


def gguf_to_hf(path: str, meta: dict, layout: dict[str, torch.Size]
               ) -> dict[str, list[tuple[str, int | None]]]:
    """`{GGUF tensor name: [(HF name, expert index or None)]}` for the HF names of `layout`:
    each named by gguf's `TensorNameMap`, the experts of a layer sharing their stacked
    tensor (index = position in the stack)."""
    names = tensor_name_map(path, meta)
    out: dict[str, list[tuple[str, int | None]]] = {}
    for hf_name in layout:
        base, _, suffix = hf_name.rpartition(".")
        m = _EXPERT.fullmatch(base)
        expert = int(m["e"]) if m else None
        target = names.get_name(f"{m['head']}.{m['tail']}" if m else base)
        if target is not None:
            out.setdefault(f"{target}.{suffix}", []).append((hf_name, expert))
    return out


def check_types(path: str, meta: dict, table: list[TensorInfo]) -> None:
    """Refuse (`HFConversionError`, one line naming the architecture, or the type, the
    tensor and the fix) a GGUF file whose quantization cannot be kept: an architecture not
    in `KEEPS_ARCHITECTURES`, a tensor of a type other than the kept block types
    (`layers.quant.formats.BY_GGML_TYPE`) and `FLOAT_TYPES` (IQ*, Q2_K, Q3_K, Q5_*, ...).
    The types must be ones gguf knows (`check_tensor_data` first)."""
    import gguf

    arch = meta["general.architecture"]
    if arch not in KEEPS_ARCHITECTURES:
        raise HFConversionError(f"{path}: GGUF architecture {arch!r} is not one whose "
                                f"quantization is kept (kept for "
                                f"{', '.join(KEEPS_ARCHITECTURES)}); {_NONE}")
    for t in table:
        kind = gguf.GGMLQuantizationType(t.ggml_type).name
        if kind not in BY_GGML_TYPE and kind not in FLOAT_TYPES:
            raise HFConversionError(
                f"{path}: tensor {t.name!r} is {kind}, which is not kept as a low-bit weight "
                f"(kept: {', '.join(BY_GGML_TYPE)}, and {', '.join(FLOAT_TYPES)} tensors); "
                f"{_NONE}")


def _plan(path: str, meta: dict, table: list[TensorInfo], hf_config
          ) -> list[tuple[TensorInfo, str, list[tuple[str, int | None]], dict]]:
    """`[(tensor, ggml type name, [(HF name, expert)], HF shape)]` in table order, every
    tensor checked from the header alone (type kept, HF name, HF shape);
    `HFConversionError` in one line."""
    import gguf

    check_types(path, meta, table)
    layout = hf_layout(hf_config)
    targets = gguf_to_hf(path, meta, layout)
    plan = []
    for t in table:
        kind = gguf.GGMLQuantizationType(t.ggml_type).name
        entries = targets.get(t.name)
        if not entries:
            raise HFConversionError(f"{path}: tensor {t.name!r} has no place in the "
                                    f"{hf_config.model_type} model its metadata describes; "
                                    f"the file is corrupt or was edited, convert or download "
                                    f"it again")
        shape = tuple(reversed(t.dims))  # ggml lists the innermost dimension first
        experts = [e for _, e in entries]
        stacked = experts[0] is not None
        if stacked:
            if len(shape) != 3 or sorted(experts) != list(range(shape[0])):
                raise HFConversionError(
                    f"{path}: tensor {t.name!r} of shape {list(shape)} does not stack the "
                    f"{len(experts)} experts the metadata gives; the file is corrupt, convert "
                    f"or download it again")
            shape = shape[1:]
        want = tuple(layout[entries[0][0]])
        same = shape == want if len(shape) > 1 and len(want) > 1 else \
            [s for s in shape if s != 1] == [s for s in want if s != 1]
        if not same:
            raise HFConversionError(
                f"{path}: tensor {t.name!r} ({kind}) has shape {list(shape)}"
                f"{' per expert' if stacked else ''}, but {entries[0][0]} of the model its "
                f"metadata describes is {list(want)} (nothing was allocated); the file is "
                f"corrupt or was edited, convert or download it again")
        plan.append((t, kind, entries, want))
    return plan


def _row_order(processor, name: str, rows: int) -> torch.Tensor | None:
    """The source row of each output row of GGUF tensor `name` as transformers' processor
    reorders it (None: kept in order), found by processing the row numbers."""
    probe = np.arange(rows, dtype=np.int64).reshape(rows, 1)
    result = processor.process(weights=probe, name=name)
    order = np.asarray(result.weights).reshape(-1)
    if result.name != name or order.shape != (rows,) or \
            not np.array_equal(np.sort(order), probe.reshape(-1)):
        raise HFConversionError(f"transformers' GGUF reader changes the values of {name!r}, "
                                f"not only its row order, so its blocks cannot be kept; "
                                f"{_NONE}")
    return None if np.array_equal(order, probe.reshape(-1)) else torch.from_numpy(order.copy())


def read_gguf_tensors(path: str, meta: dict, table: list[TensorInfo],
                      ranges: list[tuple[int, int]], hf_config
                      ) -> dict[str, "QuantizedWeight | torch.Tensor"]:
    """`{HF name: QuantizedWeight or tensor}` of GGUF file `path` (module docstring): `meta`
    and `table` from `read_header`, `ranges` (each tensor's bytes in the file) from
    `check_tensor_data`, `hf_config` transformers' config of the file. QuantizedWeight
    `[out, in]` for 2-D block-type tensors; float tensors keep the file's dtype (1-D ones:
    float32). Raises `HFConversionError` (one line naming the tensor and the problem)
    before the file is mapped."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    plan = _plan(path, meta, table, hf_config)
    processor = TENSOR_PROCESSORS.get(meta["general.architecture"],
                                      TensorProcessor)(config=hf_config.to_dict())
    with open(path, "rb") as f:  # private: a write to a view never reaches the file
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    out: dict[str, QuantizedWeight | torch.Tensor] = {}
    for (t, kind, entries, want), (begin, end) in zip(plan, ranges):  # both in table order
        shape = tuple(reversed(t.dims))
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=end - begin, offset=begin)
        if len(shape) == 1:  # norms, biases: float32, exactly as transformers makes them
            values = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[kind])
            result = processor.process(weights=values, name=t.name)
            out[entries[0][0]] = torch.from_numpy(np.array(result.weights, np.float32)
                                                  ).reshape(want)
            continue
        rows = raw.view(*shape[:-1], -1)  # [(experts,) out, row bytes]
        order = None if entries[0][1] is not None else _row_order(processor, t.name, shape[0])
        for hf_name, expert in entries:
            data = rows if expert is None else rows[expert]
            if order is not None:
                data = data.index_select(0, order)
            if kind in FLOAT_TYPES:
                out[hf_name] = data.view(FLOAT_TYPES[kind]).view(want)
            else:
                out[hf_name] = QuantizedWeight.from_gguf(kind, data, want)
    if getattr(hf_config, "tie_word_embeddings", False) and "lm_head.weight" not in out \
            and "model.embed_tokens.weight" in out:  # tied: the same object, as in
        out["lm_head.weight"] = out["model.embed_tokens.weight"]  # transformers' dict
    return out
