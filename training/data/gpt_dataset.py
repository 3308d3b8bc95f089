"""Fixed-length GPT training samples drawn across document boundaries, splits and blends.

The sampling scheme is the one of Megatron-LM's ``GPTDataset`` and ``BlendedDataset``
(Shoeybi et al., 2019, "Megatron-LM"; the data pipeline in their repository):

1. the documents of a split are shuffled once per epoch and the epochs concatenated
   (``doc_idx``), with as many epochs as needed to cover ``num_samples``;
2. sample ``k`` is the window ``[k * s, k * s + s]`` (``s + 1`` tokens, so consecutive samples
   share one token: the last label of one is the first input of the next) of that token
   stream; ``sample_idx[k] = (position in doc_idx, offset in that document)`` of its start;
3. the samples are served in a shuffled order (``shuffle_idx``).

Every random choice comes from one ``numpy.random.RandomState(seed)``, so the same seed gives
the same samples on every rank and every run. Documents are expected to end with EOD already
(tools/preprocess_data.py appends it).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from training.data.indexed_dataset import IndexedDataset


class GPTDataset:
    """``num_samples`` samples of ``seq_length + 1`` tokens from ``documents`` of ``indexed``.

    Args:
        indexed: the token store.
        documents: int array of document indices (into ``indexed``) forming this split.
        num_samples: number of samples (``len(self)``).
        seq_length: tokens per model input; each sample has ``seq_length + 1`` tokens
            (inputs ``sample[:-1]``, labels ``sample[1:]``).
        seed: seed of the doc and sample shuffles.

    ``self[i]`` is an int64 array ``[seq_length + 1]``.

    Raises:
        ValueError: no documents, documents with no tokens, or bad num_samples/seq_length.
    """

    def __init__(self, indexed: IndexedDataset, documents: np.ndarray, num_samples: int,
                 seq_length: int, seed: int, name: str = ""):
        self.indexed = indexed
        self.documents = np.asarray(documents, dtype=np.int64)
        self.num_samples = int(num_samples)
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.name = name or getattr(indexed, "prefix", "dataset")
        if self.seq_length < 1 or self.num_samples < 1:
            raise ValueError(f"{self.name}: need seq_length >= 1 and num_samples >= 1, got "
                             f"{self.seq_length} and {self.num_samples}")
        if self.documents.size == 0:
            raise ValueError(f"{self.name}: no documents in this split")
        sizes = np.asarray(indexed.sizes, dtype=np.int64)
        tokens_per_epoch = int(sizes[self.documents].sum())
        if tokens_per_epoch == 0:
            raise ValueError(f"{self.name}: the documents of this split hold no tokens")
        # Tokens needed: s * n + 1 (the last sample's final label); round epochs up.
        needed = self.seq_length * self.num_samples + 1
        self.num_epochs = math.ceil(needed / tokens_per_epoch)
        if self.num_epochs * len(self.documents) > 500_000_000:
            raise ValueError(
                f"{num_samples} samples of {seq_length} tokens need {self.num_epochs} epochs over "
                f"the {tokens_per_epoch} tokens of this split; that index would not fit in "
                f"memory. Lower --train-iters / --global-batch-size or use more data")
        rng = np.random.RandomState(self.seed)
        self.doc_idx = np.concatenate(
            [rng.permutation(self.documents) for _ in range(self.num_epochs)])
        doc_sizes = sizes[self.doc_idx]
        ends = np.cumsum(doc_sizes)
        starts = np.arange(self.num_samples + 1, dtype=np.int64) * self.seq_length
        pos = np.searchsorted(ends, starts, side="right")
        offsets = starts - (ends[pos] - doc_sizes[pos])
        self.sample_idx = np.stack([pos, offsets], axis=1)  # [num_samples + 1, 2] int64
        self.shuffle_idx = rng.permutation(self.num_samples)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample ``i``: int64 ``[seq_length + 1]``. Raises IndexError out of range."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.name} ({self.num_samples})")
        k = int(self.shuffle_idx[i])
        (p0, o0), (p1, o1) = self.sample_idx[k], self.sample_idx[k + 1]
        p0, o0, p1, o1 = int(p0), int(o0), int(p1), int(o1)
        if p0 == p1:
            parts = [self.indexed.get(int(self.doc_idx[p0]), o0, o1 - o0 + 1)]
        else:
            parts = [self.indexed.get(int(self.doc_idx[p0]), o0)]
            parts += [self.indexed.get(int(self.doc_idx[p])) for p in range(p0 + 1, p1)]
            parts.append(self.indexed.get(int(self.doc_idx[p1]), 0, o1 + 1))
        return np.concatenate(parts).astype(np.int64)

    def __repr__(self) -> str:
        return (f"GPTDataset({self.name!r}, docs={self.documents.size}, "
                f"samples={self.num_samples}, "
                f"seq_length={self.seq_length}, epochs={self.num_epochs}, seed={self.seed})")


class BlendedDataset:
    """Mix ``datasets`` by ``weights`` into ``size`` samples (Megatron-LM's greedy blending).

    Sample ``i`` comes from the dataset whose count lags its target ``weight * (i + 1)`` the
    most (ties to the lowest index), so after any prefix of ``n`` samples each dataset has
    been used within one sample of ``weight * n``. Deterministic; no randomness. Component j
    serves its samples in its own order: the c-th pick of j is ``datasets[j][c]`` (wrapping
    around if a component is shorter than its share, which ``ceil(w * size * 1.005)`` avoids).

    ``self[i]`` is the component's sample (int64 ``[seq_length + 1]`` for GPTDatasets);
    ``dataset_index`` / ``dataset_sample_index`` (both ``[size]``) record the choice.

    Raises:
        ValueError: mismatched lengths, negative or all-zero weights, size < 1.
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"BlendedDataset needs one weight per dataset, got {len(datasets)} "
                             f"datasets and {len(weights)} weights")
        w = np.asarray(weights, dtype=np.float64)
        if (w < 0).any() or w.sum() <= 0:
            raise ValueError(f"blend weights must be >= 0 with a positive sum, got {list(weights)}")
        if size < 1:
            raise ValueError(f"BlendedDataset size must be >= 1, got {size}")
        self.datasets = list(datasets)
        self.weights = w / w.sum()
        self.size = int(size)
        self.dataset_index, self.dataset_sample_index = _greedy_blend(self.weights, self.size)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        if not 0 <= i < self.size:
            raise IndexError(f"sample {i} out of range for blend of size {self.size}")
        d = self.datasets[int(self.dataset_index[i])]
        return d[int(self.dataset_sample_index[i]) % len(d)]

    def __repr__(self) -> str:
        return f"BlendedDataset(size={self.size}, weights={np.round(self.weights, 4).tolist()})"


def _greedy_blend(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Choices of the greedy blend: (dataset of each sample, its index within that dataset)."""
    k = len(weights)
    which = np.empty(size, dtype=np.int16 if k < 2**15 else np.int32)
    within = np.empty(size, dtype=np.int64)
    counts = [0] * k
    w = weights.tolist()
    for i in range(size):
        target = i + 1
        best, best_err = 0, -math.inf
        for j in range(k):
            err = w[j] * target - counts[j]
            if err > best_err:
                best, best_err = j, err
        which[i] = best
        within[i] = counts[best]
        counts[best] += 1
    return which, within


def parse_data_path(data_path: Sequence[str]) -> tuple[list[str], list[float]]:
    """Megatron ``--data-path``: ``[prefix]`` or ``[w1, prefix1, w2, prefix2, ...]``.

    Returns (prefixes, normalised weights). Raises ValueError with the expected form.
    """
    items = [str(x) for x in data_path]
    if not items:
        raise ValueError("--data-path is empty; pass a prefix or 'w1 prefix1 w2 prefix2 ...'")
    if len(items) == 1:
        return items, [1.0]
    if len(items) % 2:
        raise ValueError(f"--data-path {' '.join(items)}: expected a single prefix or "
                         "weight/prefix pairs like '0.7 data/a_text_document "
                         "0.3 data/b_text_document'")
    try:
        weights = [float(x) for x in items[0::2]]
    except ValueError:
        raise ValueError(f"--data-path {' '.join(items)}: every odd item must be a weight "
                         "(e.g. '0.7 prefixA 0.3 prefixB')") from None
    total = sum(weights)
    if any(x < 0 for x in weights) or total <= 0:
        raise ValueError(f"--data-path weights must be >= 0 with a positive sum, got {weights}")
    return items[1::2], [x / total for x in weights]


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` (or ``"98/2/0"``, or fewer parts padded with 0) -> 3 normalised shares."""
    parts = [p for p in split.replace("/", ",").split(",") if p.strip()]
    try:
        vals = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"--split {split!r}: expected three numbers like '969,30,1'") from None
    if not 1 <= len(vals) <= 3 or any(v < 0 for v in vals) or sum(vals) <= 0:
        raise ValueError(f"--split {split!r}: expected up to three non-negative numbers with a "
                         "positive sum, like '969,30,1'")
    vals += [0.0] * (3 - len(vals))
    total = sum(vals)
    return [v / total for v in vals]


def split_documents(num_docs: int, shares: Sequence[float]) -> list[np.ndarray]:
    """Contiguous document ranges for train/valid/test (rounded cumulative boundaries)."""
    bounds = np.round(np.cumsum([0.0, *shares]) * num_docs).astype(np.int64)
    bounds[-1] = num_docs
    return [np.arange(bounds[j], bounds[j + 1], dtype=np.int64) for j in range(len(shares))]


_SPLIT_NAMES = ("train", "valid", "test")


def build_train_valid_test_datasets(data_path: list[str], split: str, seq_length: int, seed: int,
                                    train_valid_test_num_samples: tuple[int, int, int]) -> tuple:
    """Build the (train, valid, test) datasets for Megatron-style ``--data-path`` and ``--split``.

    Each dataset's documents are cut into contiguous train/valid/test ranges by ``split``
    proportions. A single prefix gives `GPTDataset`s; several give `BlendedDataset`s whose
    component j holds ``ceil(w_j * n * 1.005)`` samples (Megatron's margin).

    Returns:
        (train, valid, test): each a dataset, or None when its share in ``split`` is 0 or its
        requested number of samples is 0.

    Raises:
        FileNotFoundError / ValueError: from `IndexedDataset` for missing/corrupt files.
        ValueError: a split with samples requested and a positive share but no documents
            (e.g. "valid split of <prefix> is empty; raise its share in --split").
    """
    prefixes, weights = parse_data_path(data_path)
    shares = parse_split(split)
    if len(train_valid_test_num_samples) != 3:
        raise ValueError("train_valid_test_num_samples must be (train, valid, test)")
    indexed = {p: IndexedDataset(p) for p in dict.fromkeys(prefixes)}
    ranges = {p: split_documents(len(ds), shares) for p, ds in indexed.items()}
    out = []
    for s, name in enumerate(_SPLIT_NAMES):
        n = int(train_valid_test_num_samples[s])
        if n <= 0 or shares[s] == 0:
            out.append(None)
            continue
        for p in prefixes:
            if ranges[p][s].size == 0:
                raise ValueError(f"{name} split of {p} is empty ({len(indexed[p])} documents, "
                                 f"--split {split}); raise its share in --split or add documents")
        if len(prefixes) == 1:
            p = prefixes[0]
            out.append(GPTDataset(indexed[p], ranges[p][s], n, seq_length, seed, f"{p}:{name}"))
            continue
        parts = [GPTDataset(indexed[p], ranges[p][s], max(1, math.ceil(w * n * 1.005)),
                            seq_length, seed, f"{p}:{name}")
                 for p, w in zip(prefixes, weights)]
        out.append(BlendedDataset(parts, weights, n))
    return tuple(out)
