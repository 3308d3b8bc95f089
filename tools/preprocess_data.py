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
"""
from __future__ import annotations

import argparse
import fnmatch
import os
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from training.data.default_corpus import read_text  # noqa: E402
from training.data.indexed_dataset import IndexedDatasetBuilder  # noqa: E402
from training.data.tokenizer import (build_tokenizer, encode_documents,  # noqa: E402
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
                   help="columns to tokenize, one output per key (default text)")
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


class Corpus:
    """Documents of ``--input`` per key: ``columns`` lists the keys, ``texts(key)`` iterates."""

    def __init__(self, path: str, pattern: str, text_unit: str):
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
            import datasets

            low = path.lower()
            if low.endswith(_JSON_EXT):
                self.dataset = datasets.load_dataset("json", data_files=path, split="train")
            elif low.endswith(_PARQUET_EXT):
                self.dataset = datasets.load_dataset("parquet", data_files=path, split="train")
            else:
                self.dataset = datasets.load_dataset("text", data_files=path, split="train",
                                                     sample_by=text_unit)
        self.columns = ["text"] if self.files is not None else list(self.dataset.column_names)

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
        if self.files is not None:
            yield from (read_text(f) for f in self.files)
            return
        for batch in self.dataset.select_columns([key]).iter(batch_size=1000):
            yield from ("" if t is None else str(t) for t in batch[key])

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
    corpus = Corpus(args.input, args.pattern, args.text_unit)
    corpus.check_keys(args.json_keys)
    if args.vocab_size:
        sample = corpus.sample_file(args.json_keys)
        try:
            model = train_sentencepiece([sample], args.output_prefix, args.vocab_size)
        finally:
            os.remove(sample)
        tokenizer = build_tokenizer(model)
    else:
        tokenizer = build_tokenizer(args.tokenizer_model or args.tokenizer_dir)
    written, docs, tokens = [], 0, 0
    for key in args.json_keys:
        prefix = f"{args.output_prefix}_{key}_document"
        with IndexedDatasetBuilder(prefix, vocab_size=tokenizer.vocab_size) as builder:
            for ids in encode_documents(tokenizer, corpus.texts(key), args.append_eod,
                                        num_threads=args.workers):
                builder.add_document(ids)
                docs += 1
                tokens += len(ids)
            written += list(builder.finalize())
    if args.vocab_size:
        written.insert(0, tokenizer.path)
    print(f"preprocess_data: {docs} documents, {tokens} tokens (vocab {tokenizer.vocab_size}) in "
          f"{time.time() - t0:.1f} s; wrote {', '.join(written)}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (FileNotFoundError, ValueError) as e:
        print(f"preprocess_data: error: {e}", file=sys.stderr)
        sys.exit(2)
