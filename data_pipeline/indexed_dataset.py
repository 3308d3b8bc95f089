"""Memory-mapped token datasets: a ``.bin`` of token ids and an ``.idx`` describing documents.

The layout follows the idea of Megatron-LM's ``MMapIndexedDataset`` (Shoeybi et al., 2019):
all documents' tokens are stored back to back in ``<prefix>.bin`` and a small index lets a
reader slice any document without loading the file. The byte format is shardzoo's own::

    <prefix>.idx  (little endian)
        magic      8 bytes   b"SHZIDX\\0\\0"
        version    uint64    1
        dtype      uint8     code of the token dtype (see DTYPE_CODES), then 7 pad bytes
        num_docs   uint64
        num_tokens uint64
        sizes      int32[num_docs]   tokens per document
        offsets    int64[num_docs]   first token of each document, in tokens from .bin start
    <prefix>.bin  token ids, dtype as above, num_tokens items

Write with `IndexedDatasetBuilder` (atomic: temp files then ``os.replace``), read with
`IndexedDataset`. Regenerate damaged files with ``python tools/preprocess_data.py``.
"""
from __future__ import annotations

import os
import struct

import numpy as np

MAGIC = b"SHZIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<8sQB7xQQ")
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
_REGEN = "regenerate it with `python tools/preprocess_data.py --input ... --output-prefix ...`"


def best_dtype(vocab_size: int) -> type:
    """Smallest token dtype for ``vocab_size`` ids: uint16 below 65536, else int32."""
    return np.uint16 if vocab_size <= 65536 else np.int32


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


class IndexedDatasetBuilder:
    """Stream documents into ``<prefix>.bin`` / ``<prefix>.idx``.

    Args:
        prefix: output path without extension.
        dtype: token dtype (``np.uint16`` or ``np.int32`` usually); if None it is chosen from
            ``vocab_size`` with `best_dtype` (int32 when both are None).
        vocab_size: used only to choose ``dtype``.

    Tokens go to a temp file next to the output; `finalize` writes the index and moves both
    into place with ``os.replace`` (.bin first, .idx last), so a killed run never leaves a
    pair that reads as complete. Use as a context manager to clean up temp files on error.

    Raises (from `add_document`):
        ValueError: an id does not fit the dtype (e.g. >= 65536 with uint16).
    """

    def __init__(self, prefix: str, dtype=None, vocab_size: int | None = None):
        if dtype is None:
            dtype = best_dtype(vocab_size) if vocab_size is not None else np.int32
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"unsupported token dtype {self.dtype}; use one of "
                             f"{sorted(str(np.dtype(d)) for d in DTYPE_CODES.values())}")
        self.prefix = prefix
        d = os.path.dirname(os.path.abspath(prefix))
        os.makedirs(d, exist_ok=True)
        self._tmp_bin = f"{data_file_path(prefix)}.tmp-{os.getpid()}"
        self._tmp_idx = f"{index_file_path(prefix)}.tmp-{os.getpid()}"
        self._bin = open(self._tmp_bin, "wb")
        self._sizes: list[int] = []
        self._info = np.iinfo(self.dtype)
        self._finalized = False

    def add_document(self, ids) -> None:
        """Append one document (a list or 1-D array of token ids; its EOD included by caller)."""
        arr = np.asarray(ids)
        if arr.ndim != 1:
            raise ValueError(f"a document must be 1-D token ids, got shape {arr.shape}")
        if arr.size and (int(arr.min()) < self._info.min or int(arr.max()) > self._info.max):
            raise ValueError(f"token id range [{int(arr.min())}, {int(arr.max())}] does not fit "
                             f"{self.dtype}; build with dtype=np.int32")
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self._sizes.append(int(arr.size))

    def finalize(self) -> tuple[str, str]:
        """Write the index and publish both files atomically; return (bin_path, idx_path)."""
        self._bin.close()
        sizes = np.asarray(self._sizes, dtype=np.int64)
        offsets = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            np.cumsum(sizes[:-1], out=offsets[1:])
        if sizes.size and sizes.max() > np.iinfo(np.int32).max:
            raise ValueError("a document longer than 2**31 tokens cannot be indexed")
        with open(self._tmp_idx, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], len(sizes),
                                 int(sizes.sum())))
            f.write(sizes.astype("<i4").tobytes())
            f.write(offsets.astype("<i8").tobytes())
        bin_path, idx_path = data_file_path(self.prefix), index_file_path(self.prefix)
        os.replace(self._tmp_bin, bin_path)
        os.replace(self._tmp_idx, idx_path)
        self._finalized = True
        return bin_path, idx_path

    def abort(self) -> None:
        """Drop the temp files (called automatically when the `with` block raises)."""
        self._bin.close()
        for p in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(p):
                os.remove(p)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None or not self._finalized:
            self.abort()
        return False


class IndexedDataset:
    """Read-only, memory-mapped view of ``<prefix>.bin`` / ``<prefix>.idx``.

    ``len(ds)`` is the number of documents; ``ds[i]`` is document i as a 1-D array of
    ``ds.dtype`` (a view into the memory map, do not write to it); ``ds.sizes`` is an int32
    array ``[num_docs]`` of document lengths in tokens.

    Raises:
        FileNotFoundError: the .idx or .bin file is missing (message says how to regenerate).
        ValueError: wrong magic/version, unknown dtype, truncated index, or a .bin whose size
            does not match the index.
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        for p in (idx_path, bin_path):
            if not os.path.isfile(p):
                raise FileNotFoundError(f"indexed dataset file {p} is missing; {_REGEN}")
        with open(idx_path, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < _HEADER.size:
            raise ValueError(f"index file {idx_path} is truncated ({len(head)} bytes, header "
                             f"needs {_HEADER.size}); {_REGEN}")
        magic, version, code, n, num_tokens = _HEADER.unpack(head)
        if magic != MAGIC:
            raise ValueError(f"{idx_path} is not a shardzoo index (bad magic {magic!r}); a "
                             f"Megatron .idx is not compatible; {_REGEN}")
        if version != VERSION:
            raise ValueError(f"{idx_path} has index version {version}, this reader knows "
                             f"{VERSION}; {_REGEN}")
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx_path} has unknown dtype code {code}; {_REGEN}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = _HEADER.size + 12 * n
        actual = os.path.getsize(idx_path)
        if actual != expected:
            raise ValueError(f"index file {idx_path} is truncated or corrupt ({actual} bytes, "
                             f"expected {expected} for {n} documents); {_REGEN}")
        bin_bytes = os.path.getsize(bin_path)
        if bin_bytes != num_tokens * self.dtype.itemsize:
            raise ValueError(f"data file {bin_path} has {bin_bytes} bytes but {idx_path} "
                             f"describes {num_tokens} tokens of {self.dtype}; {_REGEN}")
        if n:
            self.sizes = np.memmap(idx_path, dtype="<i4", mode="r", offset=_HEADER.size, shape=(n,))
            self.offsets = np.memmap(idx_path, dtype="<i8", mode="r",
                                     offset=_HEADER.size + 4 * n, shape=(n,))
        else:
            self.sizes = np.zeros(0, dtype=np.int32)
            self.offsets = np.zeros(0, dtype=np.int64)
        self.num_tokens = int(num_tokens)
        if n and (int(self.sizes.min()) < 0 or int(self.offsets[0]) != 0
                  or not np.array_equal(self.offsets[1:], self.offsets[:-1] + self.sizes[:-1])
                  or int(self.offsets[-1]) + int(self.sizes[-1]) != num_tokens):
            raise ValueError(f"index file {idx_path} is corrupt: its document sizes and offsets "
                             f"do not tile the {num_tokens} tokens of {bin_path}; {_REGEN}")
        if num_tokens:
            self._tokens = np.memmap(bin_path, dtype=self.dtype, mode="r", shape=(num_tokens,))
        else:
            self._tokens = np.zeros(0, dtype=self.dtype)

    def __len__(self) -> int:
        return int(self.sizes.shape[0])

    def __getitem__(self, i: int) -> np.ndarray:
        """Document ``i`` (negative indices allowed) as a 1-D ``self.dtype`` array."""
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of document ``i`` (to its end when length is None).

        Raises:
            IndexError: ``i`` out of range.
        """
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"document {i} out of range for {self.prefix} ({n} documents)")
        i = int(i) % n
        size = int(self.sizes[i])
        if length is None:
            length = size - offset
        start = int(self.offsets[i]) + offset
        return self._tokens[start:start + max(0, min(length, size - offset))]

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}, docs={len(self)}, tokens={self.num_tokens}, "
                f"dtype={self.dtype})")


def exists(prefix: str) -> bool:
    """True when both ``<prefix>.bin`` and ``<prefix>.idx`` exist."""
    return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))
