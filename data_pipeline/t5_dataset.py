"""T5 span corruption over the GPT windows of the indexed .bin/.idx files.

Raffel et al. 2020, sec. 3.1.4 and 3.3.4 ("i.i.d. span corruption"), as the T5 code's
`random_spans_noise_mask` describes it: of a window of `L` raw tokens, `round(L * d)` are
noise (d = `noise_density`, 0.15), grouped in `round(noise / mean_span)` spans
(`mean_noise_span_length` 3). Noise and non-noise runs alternate, non-noise first; the
lengths of each kind are a uniformly random composition into that many positive parts. The
encoder input keeps the non-noise tokens and puts one sentinel in place of each noise span;
the target is each sentinel followed by the span it hides; both end with EOS. Sentinel k is
id `vocab_size - 1 - k` of the model's vocabulary (T5's `<extra_id_k>`: the tokenizer's ids
plus `num_sentinels` appended on top).

`L` is the longest window whose encoder input fits `encoder_seq_length`; the decoder length
must hold the matching target (`span_corruption_lengths`). Shorter inputs/targets are padded
(`pad_id`, masked out). Windows come from a `GPTDataset` (or blend) of `L - 1`-token samples,
so the order is seeded and resumable exactly as for GPT; the noise of sample `i` is drawn from
`numpy.random.default_rng([seed, i])` and depends on nothing else.
"""
from __future__ import annotations

import numpy as np


def _counts(raw: int, noise_density: float, mean_span: float) -> tuple[int, int]:
    """(noise tokens, noise spans) of a raw window of `raw` tokens."""
    noise = min(max(int(round(raw * noise_density)), 1), raw - 1)
    spans = max(int(round(noise / mean_span)), 1)
    return noise, spans


def span_corruption_lengths(encoder_seq_length: int, noise_density: float = 0.15,
                            mean_span: float = 3.0) -> tuple[int, int]:
    """`(raw window length L, decoder length)`: the longest `L` whose corrupted input
    (non-noise + one sentinel per span + EOS) fits `encoder_seq_length`, and its target's
    length (noise + one sentinel per span + EOS). T5 at 512, 0.15, 3 gives (568, 114)."""
    def lengths(raw):
        noise, spans = _counts(raw, noise_density, mean_span)
        return raw - noise + spans + 1, noise + spans + 1

    raw = 2
    while lengths(raw + 1)[0] <= encoder_seq_length:
        raw += 1
    return raw, lengths(raw)[1]


def _segments(rng, items: int, parts: int) -> np.ndarray:
    """A uniformly random composition of `items` into `parts` positive lengths."""
    cuts = np.sort(rng.choice(items - 1, parts - 1, replace=False) + 1) if parts > 1 else \
        np.empty(0, np.int64)
    return np.diff(np.concatenate([[0], cuts, [items]]))


def noise_mask(rng, raw: int, noise_density: float, mean_span: float) -> np.ndarray:
    """bool `[raw]`: True on noise tokens, in alternating runs starting with non-noise."""
    noise, spans = _counts(raw, noise_density, mean_span)
    noise_lengths = _segments(rng, noise, spans)
    keep_lengths = _segments(rng, raw - noise, spans)
    runs = np.stack([keep_lengths, noise_lengths], axis=1).reshape(-1)
    return np.repeat(np.tile([False, True], spans), runs)


def corrupt(tokens: np.ndarray, mask: np.ndarray, vocab_size: int, eos_id: int
            ) -> tuple[np.ndarray, np.ndarray]:
    """`(input, target)` int64 of `tokens` with the noise `mask` (see module docstring)."""
    starts = mask & ~np.concatenate([[False], mask[:-1]])  # first token of each noise span
    sentinel = vocab_size - np.cumsum(starts)  # span k (0-based) -> vocab_size - 1 - k
    inputs = np.where(starts, sentinel, tokens)[~mask | starts]
    targets = _spans_with_sentinels(tokens, mask, starts, sentinel)
    eos = np.array([eos_id], dtype=np.int64)
    return np.concatenate([inputs, eos]).astype(np.int64), np.concatenate([targets, eos])


def _spans_with_sentinels(tokens, mask, starts, sentinel) -> np.ndarray:
    """`[sentinel_0, span 0..., sentinel_1, span 1..., ...]`."""
    pos = np.flatnonzero(mask)
    out = np.empty(pos.size + int(starts.sum()), dtype=np.int64)
    is_start = starts[pos]
    where = np.arange(pos.size) + np.cumsum(is_start)  # each noise token after its sentinel
    out[where] = tokens[pos]
    out[where[is_start] - 1] = sentinel[pos[is_start]]
    return out


def uncorrupt(inputs: np.ndarray, targets: np.ndarray, vocab_size: int,
              num_sentinels: int) -> np.ndarray:
    """The original window from `corrupt`'s unpadded `(input, target)` (each ending with
    its EOS, which is dropped): each sentinel of the input replaced by what follows it in
    the target."""
    first = vocab_size - num_sentinels
    spans, current = {}, None
    for t in targets[:-1]:
        if t >= first:
            current = spans.setdefault(int(t), [])
        elif current is not None:
            current.append(int(t))
    out = []
    for t in inputs[:-1]:
        out.extend(spans.get(int(t), []) if t >= first else [int(t)])
    return np.asarray(out, dtype=np.int64)


class T5SpanCorruptionDataset:
    """Span-corrupted T5 samples over `windows` (a GPTDataset/BlendedDataset of `L - 1`-token
    samples: each item holds `L` tokens).

    `self[i]` is a dict of numpy arrays (Megatron's T5 field names): `text_enc` int64
    `[encoder_seq_length]`, `enc_mask` bool (True = real token), `labels` int64
    `[decoder_seq_length]` (the target), `loss_mask` float32 (1 on target tokens).
    `sample_id(i)` is the window's id (the metrics' batch digest uses it).
    """

    def __init__(self, windows, *, encoder_seq_length: int, decoder_seq_length: int,
                 vocab_size: int, num_sentinels: int, eos_id: int, pad_id: int, seed: int,
                 noise_density: float = 0.15, mean_noise_span_length: float = 3.0):
        self.windows = windows
        self.encoder_seq_length, self.decoder_seq_length = encoder_seq_length, decoder_seq_length
        self.vocab_size, self.num_sentinels = vocab_size, num_sentinels
        self.eos_id, self.pad_id, self.seed = eos_id, pad_id, seed
        self.noise_density, self.mean_span = noise_density, mean_noise_span_length
        self.raw_length, need = span_corruption_lengths(encoder_seq_length, noise_density,
                                                        mean_noise_span_length)
        if need > decoder_seq_length:
            raise ValueError(f"span corruption of {self.raw_length}-token windows into "
                             f"--seq-length {encoder_seq_length} needs targets of {need} "
                             f"tokens; raise --decoder-seq-length to >= {need}")
        _, spans = _counts(self.raw_length, noise_density, mean_noise_span_length)
        if spans > num_sentinels:
            raise ValueError(f"a sample has {spans} noise spans but only {num_sentinels} "
                             f"sentinels (--vocab-extra-ids); raise it to >= {spans}")

    def __len__(self) -> int:
        return len(self.windows)

    def sample_id(self, i: int):
        return self.windows.sample_id(i)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        tokens = np.asarray(self.windows[i], dtype=np.int64)
        if tokens.size != self.raw_length:
            raise ValueError(f"window {i} has {tokens.size} tokens, expected {self.raw_length}")
        rng = np.random.default_rng([self.seed, int(i)])
        mask = noise_mask(rng, tokens.size, self.noise_density, self.mean_span)
        inputs, targets = corrupt(tokens, mask, self.vocab_size, self.eos_id)
        enc = np.full(self.encoder_seq_length, self.pad_id, dtype=np.int64)
        enc[:inputs.size] = inputs
        labels = np.full(self.decoder_seq_length, -100, dtype=np.int64)
        labels[:targets.size] = targets
        return {"text_enc": enc, "enc_mask": np.arange(enc.size) < inputs.size,
                "labels": labels, "loss_mask": (labels != -100).astype(np.float32)}
