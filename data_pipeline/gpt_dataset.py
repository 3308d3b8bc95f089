"""Fixed-length GPT training samples drawn across document boundaries, splits and blends.

The sampling idea is the one of Megatron-LM's ``GPTDataset`` and ``BlendedDataset``
(Shoeybi et al., 2019, "Megatron-LM"; the data pipeline in their repository): documents of a
split are shuffled, concatenated into a token stream, cut into windows of ``s + 1`` tokens
(consecutive windows share one token: the last label of one is the first input of the next),
and the windows are served in a shuffled order. Unlike Megatron, whose shuffles span all the
epochs a run needs (so the order depends on the run's length), every epoch here is its own,
self-contained unit, which makes the sample sequence one fixed, unbounded order for a seed:

1. epoch ``e`` shuffles the split's documents with ``numpy.random.default_rng([seed, e])``
   and concatenates them; it holds ``n_e = (tokens_per_epoch - 1) // s`` windows (the last
   ``< s`` tokens of the epoch are not used);
2. global sample ``i`` is window ``shuffle_e[i % n_e]`` of epoch ``e = i // n_e``, where
   ``shuffle_e`` is a permutation drawn from the same generator.

So the first N samples are the same whatever ``--train-iters`` or ``--global-batch-size`` a
run uses, and a run that reads samples ``[0, consumed_samples)`` and resumes at
``consumed_samples`` reads every window of an epoch exactly once before the next epoch starts.
``sample_id(i) = e * n_e + shuffle_e[i % n_e]`` names a window uniquely (tests and the
metrics' per-step hash use it). Documents are expected to end with EOD already
(tools/preprocess_data.py appends it).
"""
from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from typing import Sequence

import numpy as np

from data_pipeline.data_path import parse_data_path
from data_pipeline.indexed_dataset import IndexedDataset

_CACHED_EPOCHS = 2  # epoch indices kept in memory (a run reads one epoch at a time)


class GPTDataset:
    """The unbounded sample sequence of ``documents`` of ``indexed`` (see module docstring).

    Args:
        indexed: the token store.
        documents: int array of document indices (into ``indexed``) forming this split.
        num_samples: samples this run plans to read (``len(self)``; any index >= 0 is
            served, later epochs are built on first use).
        seq_length: tokens per model input; each sample has ``seq_length + 1`` tokens
            (inputs ``sample[:-1]``, labels ``sample[1:]``).
        seed: seed of the per-epoch document and sample shuffles.

    ``self[i]`` is an int64 array ``[seq_length + 1]``; ``self.epoch_samples`` is ``n_e``.

    Raises:
        ValueError: no documents, fewer than ``seq_length + 1`` tokens in the split, or bad
            num_samples/seq_length.
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
        self._sizes = np.asarray(indexed.sizes, dtype=np.int64)
        self.tokens_per_epoch = int(self._sizes[self.documents].sum())
        self.epoch_samples = (self.tokens_per_epoch - 1) // self.seq_length
        if self.epoch_samples < 1:
            raise ValueError(f"{self.name}: the documents of this split hold "
                             f"{self.tokens_per_epoch} tokens, fewer than one sample of "
                             f"{self.seq_length + 1}; use more data or a shorter --seq-length")
        self.num_epochs = math.ceil(self.num_samples / self.epoch_samples)  # planned
        self._epochs: OrderedDict[int, tuple] = OrderedDict()

    def _epoch(self, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(doc_idx [docs], sample_idx [n_e + 1, 2], shuffle_idx [n_e])`` of epoch ``e``:
        the document order, each window's (position in doc_idx, offset) start, the order."""
        if e in self._epochs:
            self._epochs.move_to_end(e)
            return self._epochs[e]
        rng = np.random.default_rng([self.seed, e])
        doc_idx = rng.permutation(self.documents)
        doc_sizes = self._sizes[doc_idx]
        ends = np.cumsum(doc_sizes)
        starts = np.arange(self.epoch_samples + 1, dtype=np.int64) * self.seq_length
        pos = np.searchsorted(ends, starts, side="right")
        offsets = starts - (ends[pos] - doc_sizes[pos])
        out = (doc_idx, np.stack([pos, offsets], axis=1), rng.permutation(self.epoch_samples))
        self._epochs[e] = out
        while len(self._epochs) > _CACHED_EPOCHS:
            self._epochs.popitem(last=False)
        return out

    def __len__(self) -> int:
        return self.num_samples

    def sample_id(self, i: int) -> int:
        """Which window sample ``i`` is: ``epoch * n_e + window``, unique per epoch window."""
        e, k = divmod(int(i), self.epoch_samples)
        return e * self.epoch_samples + int(self._epoch(e)[2][k])

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample ``i`` (any ``i >= 0``): int64 ``[seq_length + 1]``. Raises IndexError for
        negative ``i``."""
        if i < 0:
            raise IndexError(f"sample {i} out of range for {self.name} (indices are >= 0)")
        e, k = divmod(int(i), self.epoch_samples)
        doc_idx, sample_idx, shuffle_idx = self._epoch(e)
        w = int(shuffle_idx[k])
        (p0, o0), (p1, o1) = sample_idx[w], sample_idx[w + 1]
        p0, o0, p1, o1 = int(p0), int(o0), int(p1), int(o1)
        if p0 == p1:
            parts = [self.indexed.get(int(doc_idx[p0]), o0, o1 - o0 + 1)]
        else:
            parts = [self.indexed.get(int(doc_idx[p0]), o0)]
            parts += [self.indexed.get(int(doc_idx[p])) for p in range(p0 + 1, p1)]
            parts.append(self.indexed.get(int(doc_idx[p1]), 0, o1 + 1))
        return np.concatenate(parts).astype(np.int64)

    def __repr__(self) -> str:
        return (f"GPTDataset({self.name!r}, docs={self.documents.size}, "
                f"samples={self.num_samples}, samples/epoch={self.epoch_samples}, "
                f"seq_length={self.seq_length}, seed={self.seed})")


class BlendedDataset:
    """Mix ``datasets`` by ``weights`` (Megatron-LM's greedy blending), unbounded.

    Sample ``i`` comes from the dataset whose count lags its target ``weight * (i + 1)`` the
    most (ties to the lowest index), so after any prefix of ``n`` samples each dataset has
    been used within one sample of ``weight * n``. Deterministic, no randomness, and
    prefix-stable: the choice of sample ``i`` does not depend on ``size``, so the blend is
    built for ``size`` samples and extended on demand. The c-th pick of component j is
    ``datasets[j][c]`` (components are unbounded `GPTDataset`s: nothing wraps around).

    ``self[i]`` is the component's sample (int64 ``[seq_length + 1]`` for GPTDatasets);
    ``dataset_index`` / ``dataset_sample_index`` (at least ``[size]``) record the choice.

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
        self._counts = [0] * len(self.datasets)
        self.dataset_index = np.empty(0, dtype=np.int32)
        self.dataset_sample_index = np.empty(0, dtype=np.int64)
        self._extend(self.size)

    def _extend(self, n: int) -> None:
        """Make the blend cover at least ``n`` samples (doubling, so extension is rare)."""
        have = len(self.dataset_index)
        if n <= have:
            return
        n = max(n, 2 * have)
        which, within = _greedy_blend(self.weights, have, n, self._counts)
        self.dataset_index = np.concatenate([self.dataset_index, which])
        self.dataset_sample_index = np.concatenate([self.dataset_sample_index, within])

    def __len__(self) -> int:
        return self.size

    def _pick(self, i: int) -> tuple[int, int]:
        if i < 0:
            raise IndexError(f"sample {i} out of range for the blend (indices are >= 0)")
        self._extend(int(i) + 1)
        return int(self.dataset_index[i]), int(self.dataset_sample_index[i])

    def sample_id(self, i: int) -> tuple[int, int]:
        """``(component, component window id)`` of sample ``i`` (see `GPTDataset.sample_id`)."""
        j, c = self._pick(i)
        d = self.datasets[j]
        return j, int(d.sample_id(c)) if hasattr(d, "sample_id") else c

    def __getitem__(self, i: int):
        j, c = self._pick(i)
        return self.datasets[j][c]

    def __repr__(self) -> str:
        return f"BlendedDataset(size={self.size}, weights={np.round(self.weights, 4).tolist()})"


def _greedy_blend(weights: np.ndarray, start: int, stop: int,
                  counts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Choices of the greedy blend for samples ``[start, stop)`` given the per-component
    ``counts`` of the samples before ``start`` (updated in place): (dataset of each sample,
    its index within that dataset)."""
    k = len(weights)
    which = np.empty(stop - start, dtype=np.int32)
    within = np.empty(stop - start, dtype=np.int64)
    w = weights.tolist()
    for i in range(start, stop):
        target = i + 1
        best, best_err = 0, -math.inf
        for j in range(k):
            err = w[j] * target - counts[j]
            if err > best_err:
                best, best_err = j, err
        which[i - start] = best
        within[i - start] = counts[best]
        counts[best] += 1
    return which, within


def batch_digest(dataset, start: int, count: int) -> str:
    """Short sha1 of the sorted `sample_id`s of samples ``[start, start + count)``: equal for
    two steps that read the same set of windows, whatever their order or layout."""
    ids = sorted(str(dataset.sample_id(i)) for i in range(start, start + count))
    return hashlib.sha1(",".join(ids).encode()).hexdigest()[:12]


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
    blend = parse_data_path(data_path)
    total = sum(w for w, _ in blend)
    prefixes, weights = [p for _, p in blend], [w / total for w, _ in blend]
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
