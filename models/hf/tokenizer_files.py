"""A Hugging Face tokenizer folder as untrusted input: its files checked before transformers
parses them.

transformers reads a tokenizer's JSON files with `json.load` and indexes them unchecked (a
tokenizer.json of `{"model": 5}` is a KeyError, one nested 100,000 deep a RecursionError), and
makes Python objects of every added token (about 2.5 KB each: 100,000 of them took 440 MB).
`check_tokenizer_files(folder)` refuses, with a `TokenizerFileError` naming the file, before
any of that:

- a file transformers may read (`TOKENIZER_FILES`, `additional_chat_templates/`) larger than
  its cap (its size is read before anything parses it, so memory stays bounded; the largest
  released tokenizer.json, Gemma 3's, is 33 MB);
- a JSON file that does not parse (nested too deep included, `files.load_json`) or is not an
  object; more than `MAX_ADDED_TOKENS` added tokens in one file;
- a tokenizer.json that the `tokenizers` library's own parser refuses (its schema; nesting
  bounded at 128), or without the `added_tokens` list transformers takes from it.

`load_hf_tokenizer(folder, **kwargs)` checks, then loads with `AutoTokenizer` offline and turns
whatever transformers still raises on a file into one `TokenizerFileError` line.
"""
from __future__ import annotations

import os

from .files import UntrustedJSONError, load_json, one_line

MIB = 2**20
TOKENIZER_FILES = {  # name: largest accepted size in bytes
    "tokenizer.json": 64 * MIB,
    "vocab.json": 32 * MIB, "merges.txt": 32 * MIB, "vocab.txt": 32 * MIB,
    "tokenizer.model": 32 * MIB, "spiece.model": 32 * MIB, "sentencepiece.bpe.model": 32 * MIB,
    "tokenizer_config.json": 4 * MIB, "special_tokens_map.json": 4 * MIB,
    "added_tokens.json": 4 * MIB, "chat_template.json": 4 * MIB, "chat_template.jinja": 4 * MIB,
}
CHAT_TEMPLATES_DIR, CHAT_TEMPLATE_BYTES = "additional_chat_templates", 4 * MIB
MAX_ADDED_TOKENS = 2**16  # real tokenizers add at most a few thousand
_FIX = "replace it with the tokenizer's own file"
# where each file lists its added tokens ("": the whole file), and as what
_ADDED = {"tokenizer.json": ("added_tokens", list), "added_tokens.json": ("", dict),
          "tokenizer_config.json": ("added_tokens_decoder", dict)}


class TokenizerFileError(ValueError):
    """A file of a tokenizer folder is refused (too large, malformed); the message names it."""


def check_tokenizer_files(folder: str) -> None:
    """Refuse (`TokenizerFileError` naming the file and the problem) what of tokenizer folder
    `folder` transformers would choke on (module docstring); files it does not have are
    skipped (transformers says what is missing)."""
    present = [(name, cap) for name, cap in TOKENIZER_FILES.items()
               if os.path.isfile(os.path.join(folder, name))]
    extra = os.path.join(folder, CHAT_TEMPLATES_DIR)
    if os.path.isdir(extra):
        present += [(os.path.join(CHAT_TEMPLATES_DIR, n), CHAT_TEMPLATE_BYTES)
                    for n in sorted(os.listdir(extra)) if os.path.isfile(os.path.join(extra, n))]
    for name, cap in present:  # every size before any parse
        path = os.path.join(folder, name)
        size = os.path.getsize(path)
        if size > cap:
            raise TokenizerFileError(f"{path} is {size:,} bytes, more than the {cap:,} accepted "
                                     f"for a tokenizer's {os.path.basename(name)}; {_FIX}")
    for name, cap in present:
        if name.endswith(".json"):
            _check_json(os.path.join(folder, name), cap)


def _check_json(path: str, cap: int) -> None:
    """One JSON file of a tokenizer folder: parses, is an object, and what transformers
    indexes in it has the shape it expects."""
    try:
        d = load_json(path, cap)
    except (UntrustedJSONError, OSError) as e:
        raise TokenizerFileError(f"{e}; {_FIX}") from None
    if type(d) is not dict:
        raise TokenizerFileError(f"{path} is a JSON {type(d).__name__}, not an object; {_FIX}")
    name = os.path.basename(path)
    field, kind = _ADDED.get(name, (None, None))
    added = d if field == "" else d.get(field)
    if kind is not None and added is not None:
        if type(added) is not kind:
            raise TokenizerFileError(f"{path}: {field or 'the file'} must be a JSON "
                                     f"{'list' if kind is list else 'object'}; {_FIX}")
        if len(added) > MAX_ADDED_TOKENS:
            raise TokenizerFileError(f"{path} adds {len(added):,} tokens, more than the "
                                     f"{MAX_ADDED_TOKENS:,} accepted; {_FIX}")
    if name == "tokenizer.json":
        _check_tokenizer_json(path, d)


def _check_tokenizer_json(path: str, d: dict) -> None:
    """tokenizer.json against the `tokenizers` library's parser (the format's definition; it
    bounds nesting), then the list transformers pops from it."""
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(path)  # its size was checked
    except Exception as e:  # noqa: BLE001 - the library raises a bare Exception
        raise TokenizerFileError(f"{path} is not a tokenizers-format tokenizer.json "
                                 f"({one_line(e)}); {_FIX}") from None
    tokens = d.get("added_tokens")
    if type(tokens) is not list or any(type(t) is not dict or type(t.get("id")) is not int
                                       or type(t.get("content")) is not str for t in tokens):
        raise TokenizerFileError(f"{path}: added_tokens must be a list of "
                                 f"{{\"id\": int, \"content\": str, ...}} objects; {_FIX}")


def load_hf_tokenizer(folder: str, **kwargs):
    """transformers' `AutoTokenizer.from_pretrained(folder, local_files_only=True,
    trust_remote_code=False, **kwargs)` after `check_tokenizer_files` (a folder's files; `gguf_file=` reads the GGUF's own).
    Raises `TokenizerFileError` for a refused or unreadable file (whatever transformers
    raises on one: RecursionError, KeyError, AttributeError, ... as one line naming
    `folder`), and OSError / ValueError as transformers does when there is no tokenizer."""
    if os.path.isdir(folder) and "gguf_file" not in kwargs:
        check_tokenizer_files(folder)
    from transformers import AutoTokenizer

    try:
        # trust_remote_code=False: refuse an auto_map's code without asking (the default, None,
        # asks "run the custom code? [y/N]" on stdin)
        return AutoTokenizer.from_pretrained(folder, local_files_only=True,
                                             trust_remote_code=False, **kwargs)
    except (OSError, ValueError):
        raise
    except Exception as e:  # noqa: BLE001 - transformers indexes the files unchecked
        raise TokenizerFileError(f"transformers cannot read the tokenizer in {folder} "
                                 f"({type(e).__name__}: {one_line(e)}); replace its files "
                                 f"with the tokenizer's own") from None
