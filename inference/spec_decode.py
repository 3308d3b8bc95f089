"""Speculative decoding: a cheap proposer drafts k tokens per row, the target model scores the
row's last token and the k drafts in one forward (k + 1 positions), and the exact acceptance
rule keeps a prefix of the drafts and adds one token of the target's own, so every step
emits 1 to k + 1 tokens and the output has the target's distribution whatever the drafts.

The rule (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", sec. 2.3; Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling", Algorithm 2): with p_j the target's distribution and q_j the
proposer's at draft position j,
- accept draft x_j with probability min(1, p_j(x_j) / q_j(x_j)), one uniform u of the
  request's generator per draft: accept iff u q_j(x_j) < p_j(x_j);
- at the first rejection emit one token drawn from norm(max(0, p_j - q_j)) and stop;
- when all k are accepted emit one more, the bonus token, drawn from p_k.
Each emitted token is then distributed as p (the papers' theorem; tests/test_spec_decode.py
checks it statistically). p and q are the distributions the plain sampler draws from
(inference/sampling.py `filtered_probs`: the request's temperature, top-k and top-p), so
sampled output has the plain engine's distribution; the uniforms are drawn in a different
order, so a seeded sample is not the plain engine's ids. Greedy (temperature 0) is the
rule's limit: accept while the draft equals the target's argmax, then emit the argmax, so
greedy output is the plain engine's token for token.

Proposers (`SpeculativeConfig.method`, vLLM's names):
- "ngram" (prompt lookup; Saxena 2023, transformers' `prompt_lookup_num_tokens`, vLLM's
  ngram proposer): the longest suffix of the row's tokens of `prompt_lookup_max` down to
  `prompt_lookup_min` tokens that occurred earlier in the prompt or output; the tokens that
  followed its most recent earlier occurrence are the drafts (copied with overlap, LZ77
  style, so a match close to the end continues a repeating pattern). q is a point mass: p_j
  for a draft is accepted with probability p_j(x_j), a rejection draws from p_j with x_j
  removed. No model runs, and no communication is needed: every rank holds the same tokens.
- "draft_model": a smaller model with the same tokenizer and vocabulary, sharded over the
  same tp x pp ranks with its own KV cache (`DraftModelProposer`), run k times per step
  (its first pass feeds the tokens it has not seen: the whole prompt the first time, then
  the last one or two emitted tokens). q is its `filtered_probs` under the request's
  sampling parameters; its drafts are broadcast from the last stage like sampled ids.

Rows of one micro-batch are verified together with one draft count k_b (the most any row
got, capped by `num_speculative_tokens`, the tokens the rows still may emit and the context
room of every row); a row with fewer n-gram drafts is filled up with its last token. Any
draft is exact under the rule (a point mass on any token is a valid q), so the filling only
costs the positions it computes, which the forward computes for the other rows anyway.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams, draw, filtered_probs

METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """vLLM's `--speculative-config` fields this engine implements.

    method: "ngram" (prompt lookup) or "draft_model" (`model`: a smaller checkpoint with the
        target's tokenizer). num_speculative_tokens: drafts per step (k >= 1).
    prompt_lookup_max / prompt_lookup_min: n-gram sizes tried, longest first (ngram only).
    model: the draft model's path (draft_model only; an HF folder, a .gguf file or a native
        checkpoint, loaded as infer.py's --hf / --load).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None

    def validate(self) -> "SpeculativeConfig":
        """Raise `ValueError` naming the bad field and the fix."""
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not one of {METHODS}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not (isinstance(lo, int) and isinstance(hi, int)) or not 1 <= lo <= hi:
                raise ValueError(f"prompt_lookup_min ({lo!r}) and prompt_lookup_max ({hi!r}) "
                                 f"must be integers with 1 <= min <= max")
            if self.model is not None:
                raise ValueError("a speculative model was given with method 'ngram'; drop "
                                 "the model or use method 'draft_model'")
        elif not self.model:
            raise ValueError("method 'draft_model' needs the draft model's path "
                             "(--speculative-model)")
        return self


@dataclass
class SpecStats:
    """Counts over the engine's life (vLLM's spec_decode_* counters): verified rows that
    carried drafts, drafted tokens, accepted drafts, and accepted drafts by position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def add(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos += [0] * (drafted - len(self.accepted_per_pos))
        for j in range(accepted):
            self.accepted_per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verified row with drafts: 1 + accepted / rows (1 before any)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_pos": list(self.accepted_per_pos)}


class NgramProposer:
    """Prompt-lookup drafts (see the module docstring)."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min, self.max = prompt_lookup_min, prompt_lookup_max

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` drafted ids continuing `tokens` (prompt + output), [] when no suffix of
        `prompt_lookup_min`..`prompt_lookup_max` tokens occurred before."""
        n_tokens = len(tokens)
        if k < 1 or n_tokens <= self.min:
            return []
        t = torch.tensor(tokens)
        for n in range(min(self.max, n_tokens - 1), self.min - 1, -1):
            # windows starting at 0 .. L-n-1: every earlier occurrence, not the suffix itself
            hits = (t.unfold(0, n, 1)[:-1] == t[-n:]).all(dim=1).nonzero()
            if len(hits):
                start = int(hits[-1]) + n  # the most recent occurrence
                out: list[int] = []
                for j in range(k):  # overlapping copy: past the end, copy what was drafted
                    pos = start + j
                    out.append(tokens[pos] if pos < n_tokens else out[pos - n_tokens])
                return out
        return []


def greedy_accept(target_logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """Emitted ids of a greedy row: the target's argmax at each position while it equals the
    draft, then the argmax at the first mismatch (or after the last draft). `target_logits
    [k + 1, V]` of the row's last token and its k = len(drafts) drafts."""
    best = target_logits.float().argmax(dim=-1).tolist()
    out = []
    for j, x in enumerate(drafts):
        out.append(best[j])
        if best[j] != x:
            return out
    out.append(best[len(drafts)])
    return out


def rejection_sample(target: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None) -> list[int]:
    """Emitted ids of a sampled row by the exact acceptance rule (module docstring).

    Args:
        target: `[k + 1, V]` the target's distributions p_0..p_k (non-negative weights, any
            positive sum per row; float64 is used) at the row's last token and its drafts.
        drafts: the k drafted ids.
        draft_probs: `[k, V]` the proposer's distributions q_j (non-negative, any positive
            sum), or None for point masses on the drafts (n-gram).
        generator: the request's generator (one uniform per draft considered, one per
            emitted token drawn).
    Returns 1 to k + 1 ids: the accepted drafts, then one drawn token.
    """
    p = target.double()
    p = p / p.sum(dim=-1, keepdim=True)
    q = None
    if draft_probs is not None:
        q = draft_probs.double()
        q = q / q.sum(dim=-1, keepdim=True)
    out = []
    for j, x in enumerate(drafts):
        qx = 1.0 if q is None else float(q[j, x])
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if u * qx < float(p[j, x]):
            out.append(x)
            continue
        if q is None:  # max(0, p - point mass at x): p without x
            residual = p[j].clone()
            residual[x] = 0.0
        else:
            residual = (p[j] - q[j]).clamp_(min=0.0)
        if not float(residual.sum()) > 0.0:  # p == q up to rounding: rejection had ~0 odds
            residual = p[j]
        out.append(draw(residual, generator))
        return out
    out.append(draw(p[len(drafts)], generator))
    return out


def verify_row(target_logits: torch.Tensor, drafts: list[int], params: SamplingParams,
               generator: torch.Generator | None,
               draft_probs: torch.Tensor | None = None) -> list[int]:
    """Emitted ids of one row from the target's logits `[k + 1, V]` (real vocabulary) at its
    last token and its k drafts: `greedy_accept` at temperature 0, else `rejection_sample`
    with p = the request's `filtered_probs` (`draft_probs` `[k, V]`: the draft model's q,
    None: n-gram point masses)."""
    if params.temperature == 0:
        return greedy_accept(target_logits, drafts)
    logits = target_logits.float()
    p = torch.stack([filtered_probs(logits[j], params) for j in range(len(drafts) + 1)])
    return rejection_sample(p, drafts, draft_probs, generator)
