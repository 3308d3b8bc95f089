"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p (nucleus), seeded.

The processing order is transformers' (temperature, then top-k, then top-p). A sampled id is
a pure function of the distribution and (seed, output position): `draw` runs an exponential
race over the ids, each id's uniform hashed from (seed, position, id) (`uniforms`), so no
generator state is consumed. The id at output position t is the same whether a plain decode
step, the prefill that recomputes a preempted request, or a speculative verify step produces
it, at any layout, batch composition, chunk size and prefix-cache state (`SamplingParams.seed`;
an unseeded request gets a random seed when queued). Sampled rows read the logits rounded to
multiples of 2^-10 (`LOGIT_GRID`): layouts sum in different orders and differ by ~1e-6,
which would otherwise move an id across the top-p edge or decide a close race now and then;
rounded, the draw differs only when a logit sits within ~1e-6 of a grid point.

Log-probabilities (`SamplingParams.logprobs`, `token_logprobs`) are those of the raw model
output: log_softmax of the unrounded logits over the real vocabulary, before temperature,
top-k and top-p, as vLLM returns by default (`--logprobs-mode raw_logprobs`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from layers.dropout import MASK32, MIX32_MULTIPLIERS, mix32, mix32_int

from . import sampling_kernels

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20  # alternatives per token at most (vLLM's --max-logprobs default)
LOGIT_GRID = 2.0 ** -10


class SamplingError(ValueError):
    """A sampling parameter is out of range; the message names it (`param` is its name)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How one request generates.

    max_new_tokens: tokens to generate at most (>= 1).
    temperature: 0 = greedy (argmax); > 0 divides the logits before sampling.
    top_k: keep the k most likely ids (0 = all). top_p: smallest set of ids whose
    probability reaches top_p (1.0 = all). seed: keys the request's draws (`uniforms`).
    stop: strings that end the generation (not included in the text).
    ignore_eos: keep generating past EOS (benchmarks).
    logprobs: None = no log-probabilities; N in [0, MAX_LOGPROBS] = each generated token's
    log-probability and the N most likely ids at its position (vLLM's field; see
    `token_logprobs` for the distribution).
    prompt_logprobs: None = none; N in [0, MAX_LOGPROBS] = each prompt token's (after the
    first) log-probability given the tokens before it, its rank in the vocabulary and the N
    most likely ids at its position (vLLM's field; `prompt_token_logprobs`).
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    grammar: str | None = None
    prompt_logprobs: int | None = None

    def validate(self) -> "SamplingParams":
        """Raise `SamplingError` naming the first bad field and its range."""
        def bad(name, msg):
            raise SamplingError(f"{name} {msg}", name)
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            bad("max_tokens", f"must be a positive integer, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or not 0.0 <= self.temperature <= 100.0:
            bad("temperature", f"must be in [0, 100], got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or
                                      not isinstance(self.seed, int)
                                      or not -2**63 <= self.seed < 2**63):
            bad("seed", f"must be a 64-bit signed integer (with n > 1: seed + n - 1 too), "
                        f"got {self.seed!r}")
        if not isinstance(self.stop, list) or len(self.stop) > MAX_STOP_STRINGS or \
                not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", f"must be a non-empty string or a list of at most {MAX_STOP_STRINGS} "
                        f"non-empty strings, got {self.stop!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(
                self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
                isinstance(self.prompt_logprobs, bool) or not isinstance(self.prompt_logprobs, int)
                or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            bad("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got "
                                   f"{self.prompt_logprobs!r}")
        return self


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
           positions: list[int]) -> torch.Tensor:
    """Next ids `[b]` int64 from `logits [b, V]` (real vocabulary only, any float dtype).

    Row i is greedy when `params[i].temperature == 0`, else `draw`n from `filtered_probs`
    with the keys `seeds[i]` (the request's seed) and `positions[i]` (the output position
    of the id: the request's output length before it).
    """
    logits = logits.float()
    out = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        if p.temperature != 0:
            out[i] = draw(filtered_probs(logits[i], p), seeds[i], positions[i])
    return out


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a sampled row draws from: `[V]` float64 weights from one row of
    logits `[V]` (float32 values), rounded to `LOGIT_GRID`, divided by the temperature
    (> 0), then top-k, softmax and top-p (transformers' order). Ids cut by top-k / top-p
    weigh 0; the weights are not renormalised after top-p (they sum to <= 1: divide by their
    sum for the distribution itself)."""
    row = torch.round(logits.double() / LOGIT_GRID) * LOGIT_GRID / p.temperature
    if 0 < p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        before = sorted_p.cumsum(0) - sorted_p  # mass strictly before each id
        sorted_p = sorted_p.masked_fill(before >= p.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return probs


# Key constants (odd, < 2^32): the seed's two halves, the position, the two 32-bit streams
_K_SEED, _K_POS, _K_HI, _K_LO = 0x243F6A89, 0x85A308D3, 0x13198A2F, 0x03707345


def uniforms(seed: int, position: int, ids: torch.Tensor) -> torch.Tensor:
    """`[n]` float64 uniforms in (0, 1), one per id of `ids [n]` (int64 in [0, 2^32)), a pure
    function of (seed (64-bit signed), position (in [0, 2^32)), id): 53 bits per id from
    32-bit hashes of the id under keys mixed from the seed and position, with the
    counter-based integer mixer of layers/dropout.py (`mix32`; Salmon et al. 2011's idea:
    no generator state). Integer arithmetic, so the same on CPU and CUDA; distinct ids of
    one key never share a value (the mixer is a bijection)."""
    key = mix32_int(mix32_int((seed & MASK32) ^ _K_SEED) ^ ((seed >> 32) & MASK32))
    key = mix32_int(key ^ (position & MASK32) ^ _K_POS)
    khi, klo = mix32_int(key ^ _K_HI), mix32_int(key ^ _K_LO)
    ext = sampling_kernels.extension() if ids.device.type == "cpu" and ids.dim() == 1 \
        and ids.dtype == torch.int64 else None
    if ext is not None:  # the same values in one pass (sampling_kernels.cpp)
        return ext.keyed_uniforms(ids, key, khi, klo, *MIX32_MULTIPLIERS)
    return _torch_uniforms(ids, key, khi, klo)


def _torch_uniforms(ids: torch.Tensor, key: int, khi: int, klo: int) -> torch.Tensor:
    """`uniforms` by torch ops (any device), from the row's key and its two stream keys."""
    h = mix32(ids ^ key)  # distinct per id; two keyed rounds more give 21 + 32 bits
    hi = mix32(h ^ khi).bitwise_right_shift_(11)
    lo = mix32(h.bitwise_xor_(klo))
    return hi.double().mul_(2.0 ** 32).add_(lo).add_(0.5).mul_(2.0 ** -53)


def draw(weights: torch.Tensor, seed: int, position: int) -> int:
    """One id drawn from non-negative `weights [V]` (any positive sum) by an exponential
    race: the id v of weight w_v > 0 minimising E_v / w_v, E_v = -log u_v the exponential
    of its `uniforms(seed, position)`; P(v) = w_v / sum(w) since min_v E_v / w_v of
    independent Exp(1) is Exp(sum w) and won by v with that probability (the Gumbel-max
    trick in another form; Maddison et al. 2014, "A* Sampling", sec. 2). With no positive
    weight (NaN logits) the id `argmax` gives, as greedy decoding would."""
    ids = (weights > 0).nonzero().flatten()
    if ids.numel() == 0:
        return int(weights.argmax())
    race = -torch.log(uniforms(seed, position, ids)) / weights[ids].double()
    return int(ids[race.argmin()])


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Log-probabilities of the ids `ids [b]` and the `k` most likely ids per row of
    `logits [b, V]` (real vocabulary only): `[b, 1 + 2k]` float64, row i =
    `(logprob of ids[i], k ids in decreasing probability, their k logprobs)` (ids are exact
    in float64, so one tensor carries both).

    The distribution is the raw model output, log_softmax(logits) in float32, before
    temperature / top-k / top-p (vLLM's default `raw_logprobs`; OpenAI documents its values
    as the model's). -inf stays -inf (a logit of -inf); a NaN logit gives NaN.
    """
    return _logprob_table(torch.log_softmax(logits.float(), dim=-1), ids, k)


def _logprob_table(lp: torch.Tensor, ids: torch.Tensor, k: int, rank: bool = False):
    """`[b, 1 (+ 1) + 2k]` float64 from log-probabilities `lp [b, V]`: the logprob of `ids`,
    (with `rank`: 1 + the number of ids strictly more likely), the k most likely ids and
    their logprobs."""
    chosen = lp.gather(1, ids.to(lp.device).view(-1, 1))
    parts = [chosen, (lp > chosen).sum(dim=1, keepdim=True) + 1] if rank else [chosen]
    if k:
        top = lp.topk(min(k, lp.shape[-1]), dim=-1)
        parts += [top.indices, top.values]
    return torch.cat([t.double() for t in parts], dim=1)


def prompt_token_logprobs(logits: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """`[m, 2 + 2k]` float64 for prompt tokens `ids [m]` read at `logits [m, V]` (row j: the
    logits at the position before token j): `(logprob of ids[j], its rank, k ids in
    decreasing probability, their k logprobs)`. The rank is 1 + the number of ids strictly
    more likely (vLLM's `Logprob.rank`); the distribution is `token_logprobs`'."""
    return _logprob_table(torch.log_softmax(logits.float(), dim=-1), ids, k, rank=True)


def unpack_prompt_logprobs(row: list[float], token: int, n: int) -> tuple:
    """One row of `prompt_token_logprobs` as `(token, logprob, rank, [(id, logprob)] x
    min(n, k))`."""
    token, logprob, top = unpack_logprobs([row[0]] + row[2:], token, n)
    return token, logprob, int(row[1]), top


def unpack_logprobs(row: list[float], token: int, n: int) -> tuple:
    """One row of `token_logprobs` (k alternatives) as `(token, logprob, [(id, logprob)] x
    min(n, k))`."""
    k = (len(row) - 1) // 2
    return token, row[0], [(int(row[1 + j]), row[1 + k + j]) for j in range(min(n, k))]
