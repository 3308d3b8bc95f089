"""A model's generation config (transformers' `generation_config.json`), read as untrusted
input: the stop ids that end generation, and the fields a round trip carries.

- `generation_config(source, vocab_size) -> dict`: the checked fields of an `HFSource` (its
  folder's generation_config.json, else the ids of config.json, as transformers falls back;
  a GGUF file: transformers' reading of its metadata) or of a folder holding the file (a
  native checkpoint: `{}` when it has none).
- `eos_token_ids(generation_config, tokenizer) -> list[int]`: the ids that end a request.
- `write_generation_config(folder, fields)`: the file as transformers reads it.

Rules (docs/DECISIONS.md): the file is at most `MAX_BYTES` and a JSON object; `bos_token_id`,
`eos_token_id`, `pad_token_id`, `decoder_start_token_id` are an int or a list of ints in
[0, vocab) — anything else is an `HFConversionError` naming the file and field, since a stop
id we cannot honour would let generation run on. The sampling fields in `_SAMPLING` are kept
when their type and range are right, else dropped with a `GenerationConfigWarning` (as
transformers flags them and carries on); other fields are not carried. A file that is not
valid JSON or not an object is ignored with a warning, as transformers ignores it (it falls
back to config.json).
"""
from __future__ import annotations

import json
import math
import os
import warnings

from .files import InvalidJSON, read_json
from .rules import HFConversionError

GENERATION_CONFIG = "generation_config.json"
MAX_BYTES = 2**20  # real files are under 2 KB
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def _number(lo: float, hi: float, lo_open: bool = False):
    return lambda v: type(v) in (int, float) and math.isfinite(v) and \
        (lo < v if lo_open else lo <= v) and v <= hi


# sampling defaults the file may carry (transformers' names) -> their check
_SAMPLING = {
    "do_sample": lambda v: type(v) is bool,
    "temperature": _number(0.0, math.inf),
    "top_p": _number(0.0, 1.0, lo_open=True),
    "top_k": lambda v: type(v) is int and v >= 0,
    "min_p": _number(0.0, 1.0),
    "repetition_penalty": _number(0.0, math.inf, lo_open=True),
    "max_new_tokens": lambda v: type(v) is int and v >= 1,
    "max_length": lambda v: type(v) is int and v >= 1,
}


class GenerationConfigWarning(UserWarning):
    """A generation config field (or file) that was ignored; the message names it."""


def _token_ids(value, vocab_size: int) -> bool:
    ids = value if type(value) is list else [value]
    return bool(ids) and all(type(i) is int and 0 <= i < vocab_size for i in ids)


def check_generation_config(d: dict, vocab_size: int, where: str, strict: bool = True) -> dict:
    """The fields of generation config dict `d` (read from `where`) that we carry, checked.
    Token ids that are not an int or a non-empty list of ints in [0, vocab_size) raise
    `HFConversionError` naming `where` and the field (with `strict=False`, as for the ids of
    config.json, they are dropped with a warning); bad sampling fields are dropped with a
    `GenerationConfigWarning`; `None` values count as absent."""
    out = {}
    for key, value in d.items():
        if value is None:
            continue
        if key in TOKEN_ID_FIELDS:
            if _token_ids(value, vocab_size):
                out[key] = value
                continue
            problem = (f"{where}: {key} {value!r} is not a token id (an int in [0, "
                       f"{vocab_size}), the model's vocabulary) nor a list of them")
            if strict:
                raise HFConversionError(f"{problem}; correct it or delete the file")
            warnings.warn(f"{problem}; ignored", GenerationConfigWarning, stacklevel=2)
        elif key in _SAMPLING:
            if _SAMPLING[key](value):
                out[key] = value
            else:
                warnings.warn(f"{where}: {key} {value!r} is not a valid value; ignored (as "
                              f"transformers ignores it)", GenerationConfigWarning,
                              stacklevel=2)
    return out


def read_generation_config(path: str, vocab_size: int) -> dict | None:
    """The checked fields of the generation_config.json file `path`; None when there is no
    such file, or (with a warning) when it is not a JSON object. Raises `HFConversionError`
    for a file over `MAX_BYTES` or a bad token id."""
    if not os.path.isfile(path):
        return None
    try:
        d = read_json(path, MAX_BYTES)
    except InvalidJSON as e:
        warnings.warn(f"{e}; ignored, as transformers ignores it", GenerationConfigWarning,
                      stacklevel=2)
        return None
    if type(d) is not dict:
        warnings.warn(f"{path} is a JSON {type(d).__name__}, not an object; ignored, as "
                      f"transformers ignores it", GenerationConfigWarning, stacklevel=2)
        return None
    return check_generation_config(d, vocab_size, path)


def generation_config(source, vocab_size: int) -> dict:
    """The checked generation config of `source`: an `HFSource` (models/hf/files.py) or a
    folder (a native checkpoint) that may hold generation_config.json. An HF folder without
    the file, and a GGUF file, give the token ids of their config (transformers'
    `GenerationConfig.from_model_config`; bad ones dropped with a warning)."""
    if isinstance(source, str):
        return read_generation_config(os.path.join(source, GENERATION_CONFIG), vocab_size) or {}
    if source.kind != "gguf":
        found = read_generation_config(os.path.join(source.path, GENERATION_CONFIG), vocab_size)
        if found is not None:
            return found
    where = source.path if source.kind == "gguf" else os.path.join(source.path, "config.json")
    ids = {k: source.config[k] for k in TOKEN_ID_FIELDS if k in source.config}
    return check_generation_config(ids, vocab_size, where, strict=False)


def eos_token_ids(generation_config: dict | None, tokenizer) -> list[int]:
    """The ids that end a request: the generation config's `eos_token_id` (an int or a list)
    and the tokenizer's end-of-document id (`tokenizer.eod`), as vLLM adds the config's to
    the tokenizer's; transformers' generate uses the config's alone, which is the same set
    whenever it holds the tokenizer's. Empty without either."""
    eos = (generation_config or {}).get("eos_token_id")
    ids = [] if eos is None else list(eos) if type(eos) is list else [eos]
    if tokenizer is not None and tokenizer.eod not in ids:
        ids.append(int(tokenizer.eod))
    return ids


def write_generation_config(folder: str, fields: dict) -> None:
    """Write `fields` as `folder/generation_config.json` (transformers reads it back with
    `GenerationConfig.from_pretrained`; values as given, so a round trip is exact)."""
    with open(os.path.join(folder, GENERATION_CONFIG), "w") as f:
        json.dump(fields, f, indent=2)
        f.write("\n")
