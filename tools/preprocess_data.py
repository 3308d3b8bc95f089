"""Tokenize a corpus into shardzoo's memory-mapped ``.bin``/``.idx`` format (Megatron's flags).

Examples (from the repo root)::

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \\
        --output-prefix data/corpus --tokenizer-model tok.model
    python tools/preprocess_data.py --input src/ --pattern '*.py' --output-prefix data/code \\
        --vocab-size 8192          # trains data/code.model first

``--input`` may be a text file, a folder of files (recursive, one document per file, read
directly), a .jsonl/.json or .parquet file, or a folder written by ``datasets``'
``save_to_disk``; all but plain folders are read through the ``datasets`` library. Each
``--json-keys`` key K is written to ``<output-prefix>_<K>_document.bin/.idx``; use the result
as ``--data-path <output-prefix>_<K>_document``.

Empty documents (missing key, null, or only whitespace) are skipped and counted in the final
summary; an input with no text at all, a binary file, an invalid JSON line or a non-string
value is refused with a one-line error (exit code 2) naming the file and line.
"""
from __future__ import annotations

import argparse
import fnmatch
import gzip
import json
import os
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from data_pipeline.indexed_dataset import IndexedDatasetBuilder  # noqa: E402
from models.tokenizer import (build_tokenizer, encode_documents,  # noqa: E402
                                     train_sentencepiece)

_JSON_EXT = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
_PARQUET_EXT = (".parquet",)


def get_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input", required=True, help="text file, folder, .jsonl/.json, .parquet, "
                   "or a datasets save_to_disk folder")
    p.add_argument("--pattern", default="*.txt",
                   help="glob of file names taken from an --input folder (default '*.txt')")
    p.add_argument("--text-unit", choices=("document", "paragraph", "line"), default="document",
                   help="for a plain text file: one document per file, per blank-line-separated "
                   "paragraph, or per line (default document)")
    p.add_argument("--json-keys", nargs="+", default=["text"],
                   help="columns to tokenize, one output per key (default text); values must "
                   "be strings: rows where a key is missing, null or only whitespace are "
                   "skipped (and counted), any other type (list, number, object) is an error")
    p.add_argument("--output-prefix", required=True)
    tok = p.add_argument_group("tokenizer (exactly one)")
    tok.add_argument("--tokenizer-model", help="SentencePiece .model file")
    tok.add_argument("--tokenizer-dir", help="Hugging Face tokenizer folder (loaded offline)")
    tok.add_argument("--vocab-size", type=int,
                     help="train a SentencePiece BPE model of this size on the input first "
                     "(saved as <output-prefix>.model)")
    p.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                   help="append the end-of-document id after each document (default on)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="tokenizer threads (default: all cores)")
    args = p.parse_args(argv)
    given = [x for x in (args.tokenizer_model, args.tokenizer_dir, args.vocab_size) if x]
    if len(given) != 1:
        p.error("give exactly one of --tokenizer-model x.model, --tokenizer-dir DIR, or "
                "--vocab-size N (to train a SentencePiece model on the input)")
    return args


def _folder_files(folder: str, pattern: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        out.extend(os.path.join(dirpath, f) for f in filenames
                   if fnmatch.fnmatch(f, pattern) and not f.startswith("."))
    return sorted(out)


def _open(path: str):
    return gzip.open(path, "rb") if path.lower().endswith(".gz") else open(path, "rb")


def _binary_msg(path: str) -> str:
    return (f"{path} is a binary file (it contains NUL bytes, e.g. an image or executable), "
            "not text; remove it or narrow --input/--pattern")


def _short(value, n: int = 60) -> str:
    r = repr(value)
    return r if len(r) <= n else r[:n - 3] + "..."


def _read_file(path: str) -> str:
    """A folder file as UTF-8 (undecodable bytes replaced); binary files are refused."""
    with open(path, "rb") as f:
        data = f.read()
    if b"\0" in data:
        raise ValueError(_binary_msg(path))
    return data.decode("utf-8", errors="replace")


def _json_lines(path: str):
    """(line number, parsed object or the JSONDecodeError) for each non-blank line."""
    with _open(path) as f:
        for n, raw in enumerate(f, 1):
            if raw.strip():
                try:
                    yield n, json.loads(raw)
                except ValueError as e:
                    yield n, e


def _non_string_msg(path: str, where: str, key: str, value) -> str:
    return (f"{path} {where}: key {key!r} is not a string but {type(value).__name__} "
            f"{_short(value)}; store each document as one string (e.g. join a list of lines "
            "with newlines)")


def _bad_json_line(path: str, keys) -> str | None:
    """Message for the first line of a JSON-lines file that is not valid JSON, not an object,
    or holds a non-string value under one of ``keys``; None when every line is fine."""
    for n, obj in _json_lines(path):
        if isinstance(obj, ValueError):
            return (f"{path} line {n} is not valid JSON ({obj}); fix or remove that line "
                    "(each line must be one JSON object)")
        if not isinstance(obj, dict):
            return (f"{path} line {n} is a JSON {type(obj).__name__}, not an object; each "
                    "line must be one JSON object like {\"text\": \"...\"}")
        for key in keys:
            if not isinstance(obj.get(key), (str, type(None))):
                return _non_string_msg(path, f"line {n}", key, obj[key])
    return None


def _diagnose(path: str, kind: str, err: BaseException, keys=("text",)) -> str:
    """One line saying why ``datasets`` could not read ``path`` (scans the file; error path)."""
    cause = err.__cause__ or err.__context__ or err
    if kind == "text":
        if isinstance(cause, UnicodeDecodeError) or isinstance(err, UnicodeDecodeError):
            return (f"{path} is not UTF-8 text (a binary file?); convert it to UTF-8 or remove "
                    "it from --input")
        with _open(path) as f:
            if not f.read().strip():
                return f"no text in {path}: the file is empty or only whitespace"
    elif kind == "json":
        try:
            if path.lower().endswith((".json", ".json.gz")):
                with _open(path) as f:  # a whole-file JSON (array/object) rather than JSON lines
                    try:
                        json.loads(f.read())
                        return (f"could not read {path} ({type(cause).__name__}: {cause}); "
                                "write it as JSON lines, one object per line")
                    except ValueError:
                        pass
            msg = _bad_json_line(path, keys)
            if msg:
                return msg
            if next(_json_lines(path), None) is None:
                return f"{path} has no JSON lines: the input has no documents"
        except UnicodeDecodeError:
            return f"{path} is not UTF-8 text (a binary file?); pass a UTF-8 .jsonl file"
    msg = str(cause).strip().splitlines()[-1] if str(cause).strip() else ""
    return (f"could not read {path} as {kind} ({type(cause).__name__}"
            f"{': ' + msg if msg else ''}); check the file's format")


class Corpus:
    """Documents of ``--input`` per key: ``columns`` lists the keys, ``texts(key)`` iterates."""

    def __init__(self, path: str, pattern: str, text_unit: str, keys: tuple[str, ...] = ("text",)):
        if not os.path.exists(path):
            raise FileNotFoundError(f"--input {path} does not exist")
        self.path, self.files, self.dataset = path, None, None
        if os.path.isdir(path):
            if any(os.path.isfile(os.path.join(path, m))
                   for m in ("dataset_info.json", "state.json", "dataset_dict.json")):
                self.dataset = self._load_from_disk(path)
            else:
                self.files = _folder_files(path, pattern)
                if not self.files:
                    raise ValueError(f"--input folder {path} has no files matching --pattern "
                                     f"{pattern!r}; pass e.g. --pattern '*.py'")
        else:
            self.dataset = self._load_file(path, text_unit, keys)
        self.columns = ["text"] if self.files is not None else list(self.dataset.column_names)
        self.skipped: dict[str, int] = {}  # key -> empty/missing documents of the last pass

    @staticmethod
    def _load_file(path: str, text_unit: str, keys=("text",)):
        low = path.lower()
        kind = "json" if low.endswith(_JSON_EXT) else \
            "parquet" if low.endswith(_PARQUET_EXT) else "text"
        if os.path.getsize(path) == 0:
            raise ValueError(f"no text in {path}: the file is empty (the input has no "
                             "documents)")
        if kind != "parquet":
            with _open(path) as f:
                head = f.read(8192)
            if b"\0" in head:
                raise ValueError(_binary_msg(path))
        import datasets

        verbosity = datasets.logging.get_verbosity()
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # "Failed to load JSON" lines
        try:
            if kind == "text":
                return datasets.load_dataset("text", data_files=path, split="train",
                                             sample_by=text_unit)
            return datasets.load_dataset(kind, data_files=path, split="train")
        except Exception as e:  # datasets wraps parse errors; StopIteration on empty jsonl
            raise ValueError(_diagnose(path, kind, e, keys)) from None
        finally:
            datasets.logging.set_verbosity(verbosity)

    @staticmethod
    def _load_from_disk(path: str):
        import datasets

        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise ValueError(f"--input {path} is a DatasetDict without a 'train' split "
                                 f"(splits: {list(ds)}); point --input at one split's folder")
            ds = ds["train"]
        return ds

    def check_keys(self, keys: list[str]) -> None:
        if self.files is not None:
            if keys != ["text"]:
                raise ValueError(f"--input {self.path} is a folder of files: its only key is "
                                 f"'text', not {keys}; drop --json-keys")
            return
        missing = [k for k in keys if k not in self.columns]
        if missing:
            raise ValueError(f"--json-keys {missing} not in {self.path}; its columns are "
                             f"{self.columns}")

    def __len__(self) -> int:
        return len(self.files) if self.files is not None else len(self.dataset)

    def texts(self, key: str):
        """Yield the non-empty documents of ``key``; ``self.skipped[key]`` counts the others
        (missing, null, or only whitespace). Non-string values raise ValueError."""
        self.skipped[key] = 0
        for i, t in enumerate(self._raw_texts(key)):
            if t is None or (isinstance(t, str) and not t.strip()):
                self.skipped[key] += 1
                continue
            if not isinstance(t, str):
                raise ValueError(self._type_msg(key, i, t))
            yield t

    def _raw_texts(self, key: str):
        if self.files is not None:
            yield from (_read_file(f) for f in self.files)
            return
        for batch in self.dataset.select_columns([key]).iter(batch_size=1000):
            yield from batch[key]

    def _type_msg(self, key: str, row: int, value) -> str:
        if self.path.lower().endswith(_JSON_EXT) and os.path.isfile(self.path):
            msg = _bad_json_line(self.path, [key])
            if msg:
                return msg
        return _non_string_msg(self.path, f"row {row + 1}", key, value)

    def check_text(self, keys: list[str]) -> None:
        """Raise ValueError when some key has no non-empty document at all."""
        for key in keys:
            if next(iter(self.texts(key)), None) is None:
                what = "" if keys == ["text"] else f" under key {key!r}"
                raise ValueError(f"no text in {self.path}{what}: all {len(self)} documents are "
                                 "empty or missing; check --input/--pattern/--json-keys")

    def sample_file(self, keys: list[str], max_bytes: int = 50_000_000) -> str:
        """Write up to ``max_bytes`` of text (all keys) to a temp file for tokenizer training."""
        fd, path = tempfile.mkstemp(suffix=".txt", prefix="shardzoo_sp_")
        written = 0
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            for key in keys:
                for t in self.texts(key):
                    out.write(t)
                    out.write("\n")
                    written += len(t)
                    if written >= max_bytes:
                        return path
        return path


def main(argv=None) -> int:
    args = get_args(argv)
    t0 = time.time()
    corpus = Corpus(args.input, args.pattern, args.text_unit, tuple(args.json_keys))
    corpus.check_keys(args.json_keys)
    corpus.check_text(args.json_keys)
    if args.vocab_size:
        sample = corpus.sample_file(args.json_keys)
        try:
            model = train_sentencepiece([sample], args.output_prefix, args.vocab_size)
        finally:
            os.remove(sample)
        tokenizer = build_tokenizer(model)
        if tokenizer.vocab_size < args.vocab_size:
            print(f"preprocess_data: warning: trained vocab has {tokenizer.vocab_size} ids, "
                  f"fewer than --vocab-size {args.vocab_size} (the input is too small for "
                  "more); pass a smaller --vocab-size or more text", file=sys.stderr)
    else:
        tokenizer = build_tokenizer(args.tokenizer_model or args.tokenizer_dir)
    written, docs, tokens, skipped = [], 0, 0, 0
    for key in args.json_keys:
        prefix = f"{args.output_prefix}_{key}_document"
        with IndexedDatasetBuilder(prefix, vocab_size=tokenizer.vocab_size) as builder:
            for ids in encode_documents(tokenizer, corpus.texts(key), args.append_eod,
                                        num_threads=args.workers):
                builder.add_document(ids)
                docs += 1
                tokens += len(ids)
            written += list(builder.finalize())
        skipped += corpus.skipped.get(key, 0)
    if args.vocab_size:
        written.insert(0, tokenizer.path)
    if skipped:
        print(f"preprocess_data: warning: skipped {skipped} empty or missing documents "
              f"(key missing, null or only whitespace); wrote {docs}", file=sys.stderr)
    print(f"preprocess_data: {docs} documents ({skipped} empty skipped), {tokens} tokens "
          f"(vocab {tokenizer.vocab_size}) in {time.time() - t0:.1f} s; "
          f"wrote {', '.join(written)}")
    return 0


def cli(argv=None) -> int:
    """`main` with input errors as one ``preprocess_data: error: ...`` line and exit code 2."""
    try:
        return main(argv)
    except (FileNotFoundError, ValueError) as e:
        print(f"preprocess_data: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(cli())
