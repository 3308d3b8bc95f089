"""`QuantizedWeight`: one linear weight `[out, in]` held in a low-bit format (formats.py).

The parallel linears hold either a float weight or one of these; shard it (`narrow`), save it
(`state` / `from_state`), multiply by it (`linear`) and de-quantize it (`dequantize`) without
knowing the format. Every constructor checks the storage's sizes against the shape before
anything is allocated from them (the tensors may come from an untrusted file).
"""
from __future__ import annotations

import torch

from . import formats, kernels
from .formats import FORMATS, GGUF_FORMATS, INT4_GROUP_SIZES

# rows de-quantized at a time by the reference `linear` (a bounded float32 slab, never the
# whole weight): 256 rows of SmolLM2's widest input (1536) are 1.5 MiB
SLAB_ROWS = 256


class QuantizedWeight:
    """A `[out, in]` weight in format `fmt` (formats.FORMATS) with storage `tensors` (the
    format's named tensors, formats.py). Raises ValueError when the storage does not match
    the shape, naming the tensor and the sizes."""

    def __init__(self, fmt: str, shape: tuple[int, int], tensors: dict[str, torch.Tensor]):
        if fmt not in FORMATS:
            raise ValueError(f"unknown weight format {fmt!r}; supported: {', '.join(FORMATS)}")
        out, inp = (int(s) for s in shape)
        self._group = group_size_of(fmt, tensors, inp)
        expected = storage_shapes(fmt, (out, inp), self._group)
        if set(tensors) != set(expected):
            raise ValueError(f"a {fmt} weight holds {sorted(expected)}, not {sorted(tensors)}")
        for name, (size, dtype) in expected.items():
            t = tensors[name]
            if tuple(t.shape) != size or t.dtype != dtype:
                raise ValueError(f"{fmt} weight [{out}, {inp}]: {name} is {t.dtype} "
                                 f"{list(t.shape)}, expected {dtype} {list(size)}")
        # the kernels read rows with unit column stride (a transposed view is copied once)
        tensors = {k: t if t.dim() < 2 or t.stride(-1) == 1 or t.shape[-1] == 1
                   else t.contiguous() for k, t in tensors.items()}
        self.format, self.shape, self.tensors = fmt, torch.Size((out, inp)), dict(tensors)
        # what `linear` hands the kernels each call (a decode step makes ~120 calls)
        self._product = (fmt, out, self._group) + kernels.storage(fmt, self.tensors)

    # ---- what it is
    @property
    def block_size(self) -> int:
        """Input elements per quantization block / group (int8: the whole row)."""
        return self._group

    @property
    def nbytes(self) -> int:
        """Bytes the storage holds."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors.values())).device

    def __repr__(self) -> str:
        return (f"QuantizedWeight({self.format}, [{self.shape[0]}, {self.shape[1]}], "
                f"block {self.block_size}, {self.nbytes:,} bytes)")

    # ---- values
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The exact weight `[out, in]` in `dtype` (tests, export, and small shapes)."""
        return formats.dequantize(self.format, self.tensors, tuple(self.shape)).to(dtype)

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The float32 weight rows `rows` (int64 `[n]`) -> `[n, in]`: an embedding lookup
        from a quantized table reads only the rows it needs."""
        picked = {k: v.index_select(0, rows) for k, v in self.tensors.items()}
        fast = kernels.dequantize(self.format, self.shape[1], self._group, picked)
        return fast if fast is not None else \
            formats.dequantize(self.format, picked, (rows.numel(), self.shape[1]))

    # ---- sharding
    def narrow(self, dim: int, start: int, length: int) -> "QuantizedWeight":
        """The sub-weight `w[start:start+length]` (dim 0, output rows) or `w[:, start:
        start+length]` (dim 1, input columns; start and length must be multiples of the
        block size, else ValueError). Views, no copy."""
        out, inp = self.shape
        if dim == 0:
            return QuantizedWeight(self.format, (length, inp),
                                   {k: v.narrow(0, start, length) for k, v in self.tensors.items()})
        block = self.block_size
        if self.format == "int8":  # per-row scales: every column slice keeps them whole
            return QuantizedWeight("int8", (out, length),
                                   {"qweight": self.tensors["qweight"].narrow(1, start, length),
                                    "scales": self.tensors["scales"]})
        if start % block or length % block:
            raise ValueError(f"cutting columns [{start}, {start + length}) of a {self.format} "
                             f"weight would split its blocks of {block}")
        parts = {}
        for k, v in self.tensors.items():
            per = v.shape[1] * block // inp  # storage columns per block
            parts[k] = v.narrow(1, start // block * per, length // block * per)
        return QuantizedWeight(self.format, (out, length), parts)

    def index_select_rows(self, rows: torch.Tensor) -> "QuantizedWeight":
        """The weight's output rows `rows` (int64 `[n]`), in that order: a row permutation
        (GGUF's interleaved q/k rows back to HF's order) or a gather."""
        return QuantizedWeight(self.format, (rows.numel(), self.shape[1]),
                               {k: v.index_select(0, rows) for k, v in self.tensors.items()})

    @staticmethod
    def cat_rows(weights: list["QuantizedWeight"]) -> "QuantizedWeight":
        """Stack weights of one format and input size along the output dim (a fused QKV or
        gate/up weight). ValueError when formats, input sizes or block sizes differ."""
        first = weights[0]
        for w in weights[1:]:
            if (w.format, w.shape[1], w.block_size) != (first.format, first.shape[1],
                                                        first.block_size):
                raise ValueError(f"cannot fuse {w!r} with {first!r}: fused weights need one "
                                 f"format, input size and block size")
        return QuantizedWeight(first.format, (sum(w.shape[0] for w in weights), first.shape[1]),
                               {k: torch.cat([w.tensors[k] for w in weights])
                                for k in first.tensors})

    def split_sizes_ok(self, dim: int, parts: int) -> bool:
        """Whether `narrow(dim, ...)` into `parts` equal pieces keeps every block whole."""
        size = self.shape[dim]
        if size % parts:
            return False
        return dim == 0 or self.format == "int8" or (size // parts) % self.block_size == 0

    # ---- files
    def state(self) -> dict[str, torch.Tensor]:
        """The storage as plain tensors (safetensors / torch.distributed.checkpoint)."""
        return {k: v.contiguous() for k, v in self.tensors.items()}

    @classmethod
    def from_state(cls, fmt: str, shape: tuple[int, int], tensors: dict[str, torch.Tensor]
                   ) -> "QuantizedWeight":
        """Rebuild from `state()`; sizes are checked (ValueError)."""
        return cls(fmt, shape, tensors)

    @classmethod
    def from_gguf(cls, ggml_type: str, raw: torch.Tensor, shape: tuple[int, int]
                  ) -> "QuantizedWeight":
        """A GGUF tensor of type `ggml_type` ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K") whose
        data `raw` is `uint8 [out, row_bytes]` (the file's rows, verbatim). ValueError for
        another type (naming the supported ones) or a size that does not match."""
        f = formats.BY_GGML_TYPE.get(ggml_type)
        if f is None:
            raise ValueError(f"GGUF tensor type {ggml_type} is not supported as a low-bit weight "
                             f"(supported: {', '.join(formats.BY_GGML_TYPE)}; "
                             f"or de-quantize it with --quantization none)")
        return cls(f.name, shape, {"blocks": raw})

    def to_gguf(self) -> tuple[str, torch.Tensor]:
        """(ggml type name, `uint8 [out, row_bytes]`) for a GGUF format (ValueError else)."""
        if self.format not in GGUF_FORMATS:
            raise ValueError(f"a {self.format} weight has no GGUF block form")
        return GGUF_FORMATS[self.format].ggml_type, self.tensors["blocks"].contiguous()

    @classmethod
    def quantize(cls, weight: torch.Tensor, fmt: str, group_size: int = 128,
                 symmetric: bool = True) -> "QuantizedWeight":
        """Round-to-nearest quantization of a float `[out, in]` weight (formats.quantize)."""
        return cls(fmt, tuple(weight.shape), formats.quantize(weight, fmt, group_size, symmetric))

    @classmethod
    def from_int4(cls, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
                  ) -> "QuantizedWeight":
        """An int4 weight from unpacked values `q [out, in]` (0..15), `scales [out, in / g]`
        and zero points `zeros [out, in / g]` (quantized units): weight = scale (q - zero).
        GPTQ and AWQ checkpoints are unpacked into this."""
        out, inp = q.shape
        if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
            raise ValueError("int4 values must lie in 0..15")
        return cls("int4", (out, inp), {"qweight": formats.pack_int4(q),
                                        "scales": scales.float().contiguous(),
                                        "zeros": zeros.float().contiguous()})

    # ---- compute
    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`x [..., in] @ w^T (+ bias)` -> `[..., out]` in x's dtype (float32 or bfloat16),
        by the CPU kernels of kernels.py (never a float32 copy of the whole weight; under
        torch.compile the opaque op `shardzoo::quant_linear`). Float32 accumulation of the
        exact de-quantized weight times x widened to float32."""
        return kernels.product(self._product, x, bias)

    def input_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """`grad [..., out] @ w` -> `[..., in]` in grad's dtype: the input gradient of
        `linear` (a frozen low-bit base under LoRA adapters, layers/lora.py), de-quantizing
        `SLAB_ROWS` output rows at a time (never the whole weight), float32 accumulation."""
        g2 = grad.reshape(-1, grad.shape[-1]).float()
        out = g2.new_zeros(g2.shape[0], self.shape[1])
        for start in range(0, self.shape[0], SLAB_ROWS):
            n = min(SLAB_ROWS, self.shape[0] - start)
            out += g2[:, start:start + n] @ self.narrow(0, start, n).dequantize()
        return out.to(grad.dtype).view(*grad.shape[:-1], self.shape[1])


def reference_linear(fmt: str, shape: tuple[int, int], tensors: dict[str, torch.Tensor],
                     x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference product `x [..., in] @ w^T (+ bias)` in x's dtype, de-quantizing
    `SLAB_ROWS` output rows at a time with formats.dequantize (the fallback where the kernels
    cannot be built, and the tests' baseline)."""
    w = QuantizedWeight(fmt, shape, tensors)
    x2 = x.reshape(-1, x.shape[-1]).float()
    out = x2.new_empty(x2.shape[0], w.shape[0])
    for start in range(0, w.shape[0], SLAB_ROWS):
        n = min(SLAB_ROWS, w.shape[0] - start)
        out[:, start:start + n] = x2 @ w.narrow(0, start, n).dequantize().t()
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], w.shape[0])


def group_size_of(fmt: str, tensors: dict[str, torch.Tensor], inp: int) -> int:
    """The block / group size of a weight in `fmt` with input size `inp`."""
    if fmt == "int8":
        return inp
    if fmt == "int4":
        groups = tensors["scales"].shape[1] if "scales" in tensors and \
            tensors["scales"].dim() == 2 else 0
        if not groups or inp % groups or inp // groups not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 weight with input size {inp}: scales must be [out, in / g] "
                             f"with g in {INT4_GROUP_SIZES}")
        return inp // groups
    return FORMATS[fmt].block


def storage_shapes(fmt: str, shape: tuple[int, int], group: int
                   ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The storage tensors' (shape, dtype) of a `[out, in]` weight in `fmt`. ValueError when
    the input size is not a multiple of the block size."""
    out, inp = shape
    if out < 0 or inp <= 0 or inp % group:
        raise ValueError(f"a {fmt} weight needs an input size divisible by {group}, not {inp}")
    if fmt == "int8":
        return {"qweight": ((out, inp), torch.int8), "scales": ((out, 1), torch.float32)}
    if fmt == "int4":
        return {"qweight": ((out, inp // 2), torch.uint8),
                "scales": ((out, inp // group), torch.float32),
                "zeros": ((out, inp // group), torch.float32)}
    f = GGUF_FORMATS[fmt]
    return {"blocks": ((out, inp // f.block * f.block_bytes), torch.uint8)}
