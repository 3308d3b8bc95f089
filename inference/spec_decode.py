"""Speculative decoding: a cheap proposer drafts k tokens per row, the target model scores the
row's last token and the k drafts in one forward (k + 1 positions), and verification keeps a
prefix of the drafts and adds one token of the target's own, so every step emits 1 to k + 1
tokens and the output is the target's whatever the drafts.

Verification is drafter-invariant (Daliri, Musco and Suresh 2024, "Coupling without
Communication and Drafter-Invariant Speculative Decoding"): the target's id at output
position t is `sampling.draw` from p_t, its distribution there (`filtered_probs`: the
request's temperature, top-k and top-p), keyed by (seed, t), exactly as the plain engine
draws it; drafts are accepted while they equal those ids, and the first that differs is
replaced by the target's id (after k accepted, the target's id at the next position is the
bonus token). Every emitted id is therefore the one the plain engine emits at that position
from the same tokens: a seeded request's ids do not depend on the drafts, on where steps
begin (a preempted request recomputed by a prefill, a row whose drafts a batch neighbour
capped), nor on the method; each is distributed as p_t (tests/test_spec_decode.py checks it
statistically). Greedy (temperature 0) is the same rule with the argmax.
The draft model draws its drafts with the same keys (an exponential race over the same
uniforms: the Gumbel-max coupling), so it proposes the target's id whenever its race is won
by the same id; a draft accepted with probability at least (1 - d) / (1 + d), d the total
variation distance of p and q, against Leviathan et al.'s rejection rule's 1 - d, whose
output depends on the drafts. The n-gram proposer's draft x is accepted with probability
p_t(x), as under that rule.

Proposers (`SpeculativeConfig.method`, vLLM's names):
- "ngram" (prompt lookup; Saxena 2023, transformers' `prompt_lookup_num_tokens`, vLLM's
  ngram proposer): the longest suffix of the row's tokens of `prompt_lookup_max` down to
  `prompt_lookup_min` tokens that occurred earlier in the prompt or output; the tokens that
  followed its most recent earlier occurrence are the drafts (copied with overlap, LZ77
  style, so a match close to the end continues a repeating pattern). No model runs, and no
  communication is needed: every rank holds the same tokens.
- "draft_model": a smaller model with the same tokenizer and vocabulary, sharded over the
  same tp x pp ranks (`DraftModelProposer`), its keys and values in pools of its own
  indexed by the target's block tables (a block holds both models' entries of its
  positions, as in vLLM, so --kv-cache-memory bounds the two together), run k times per step
  (its first pass feeds the tokens it has not seen: the whole prompt the first time, then
  the last one or two emitted tokens). Its drafts are `draw`n from its `filtered_probs`
  under the request's sampling parameters and keys; they are broadcast from the last stage
  like sampled ids.
- "mtp": the target's own multi-token-prediction layer (DeepSeek-V3; vLLM's "mtp"), from
  the target's last hidden state and the embedding of the token after it
  (inference/mtp_draft.py `MTPProposer`: its pools are indexed by the target's block
  tables as the draft model's are); K > 1 drafts reuse depth 1 recursively.

Each row drafts k_i tokens (at most `num_speculative_tokens` and the tokens it may still
emit less one; n-gram: fewer when its match is short or missing). The rows of a micro-batch
are verified in one forward of k_b + 1 positions (k_b = the largest k_i); a shorter row is
padded with its last token, whose positions are computed and never read. k_b must keep every
row's positions before --max-model-len, so a row that close to the end caps its batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .block_manager import block_tables
from .sampling import SamplingParams, draw, filtered_probs

METHODS = ("ngram", "draft_model", "mtp")


@dataclass
class SpeculativeConfig:
    """vLLM's `--speculative-config` fields this engine implements.

    method: "ngram" (prompt lookup), "draft_model" (`model`: a smaller checkpoint with the
        target's tokenizer) or "mtp" (the target's multi-token-prediction layer).
        num_speculative_tokens: drafts per step (k >= 1).
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
        elif self.method == "mtp":
            if self.model is not None:
                raise ValueError("a speculative model was given with method 'mtp' (the "
                                 "target's own MTP layer drafts); drop the model")
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


def verify_row(target_logits: torch.Tensor, drafts: list[int], params: SamplingParams,
               seed: int, position: int) -> list[int]:
    """Emitted ids of one row (module docstring) from the target's logits `[k + 1, V]` (real
    vocabulary) at its last token and its k drafts, whose first id is at output `position`
    of the request seeded `seed`: `greedy_accept` at temperature 0, else the drafts while
    each equals the target's `draw` from `filtered_probs` keyed by (seed, position + j),
    then the target's id at the first mismatch or after the last draft."""
    if params.temperature == 0:
        return greedy_accept(target_logits, drafts)
    logits = target_logits.float()
    out = []
    for j in range(len(drafts) + 1):
        out.append(draw(filtered_probs(logits[j], params), seed, position + j))
        if j == len(drafts) or out[j] != drafts[j]:
            return out


def pipeline_forward(runner, ids: torch.Tensor, tables: torch.Tensor, starts: torch.Tensor,
                     last: torch.Tensor) -> torch.Tensor | None:
    """One forward of `runner`'s model over every pipeline stage in turn, outside the
    engine's ticks (the draft model's passes): stage s receives from s - 1, runs, sends to
    s + 1. The last stage's logits `[b, V]` (`ModelRunner.forward`), None elsewhere. Every
    rank of the replica calls it with the same arguments."""
    from parallel_state import p2p

    hidden = None
    if not runner.first:
        hidden = p2p.communicate(runner.spec(ids), recv_prev=True)[0]
    out = runner.forward(ids, tables, starts, last, hidden)
    if not runner.last:
        p2p.communicate(runner.spec(ids), send_next=(out,))
        return None
    return out


class DraftModelProposer:
    """Drafts of a smaller model with the target's vocabulary (see the module docstring),
    sharded like the target over the replica's tp x pp ranks. Its paged KV cache has as
    many blocks as the target's and is indexed by the same block tables (a request's
    `blocks`): the engine sizes the target's cache for both models' bytes per token
    (`kv_bytes_per_token`) and then `attach`es the draft's pools, so --kv-cache-memory
    bounds the two together and no block manager of its own is needed. `cached` counts the
    tokens of a request's stream the draft holds; a request starts over (its first pass
    re-reads its whole stream) after `release` (the request ended or was preempted).

    Raises `ValueError` when the draft cannot propose for the target: another vocabulary
    size, fewer positions than `max_seq_length`, or an encoder-decoder model.
    """

    def __init__(self, model, target_config, max_seq_length: int, compile: bool = False):
        from .runner import kv_bytes_per_token

        cfg = model.config
        if getattr(cfg, "is_encoder_decoder", False):
            raise ValueError("the speculative model is an encoder-decoder (T5); use a "
                             "decoder-only model with the target's tokenizer")
        if cfg.vocab_size != target_config.vocab_size:
            raise ValueError(f"the speculative model's vocabulary ({cfg.vocab_size} ids) is "
                             f"not the target's ({target_config.vocab_size}); the draft must "
                             f"share the target's tokenizer and vocabulary")
        if cfg.max_position_embeddings < max_seq_length:
            raise ValueError(f"the speculative model holds {cfg.max_position_embeddings} "
                             f"positions, fewer than --max-model-len {max_seq_length}; lower "
                             f"--max-model-len or use another draft")
        self.model, self.max_len, self.compile = model, max_seq_length, compile
        self.kv_bytes_per_token = kv_bytes_per_token(model)  # on this rank
        self.runner = None  # `attach`
        self.cached: dict[str, int] = {}  # request id -> tokens of its stream in the cache

    def attach(self, num_blocks: int, block_size: int) -> None:
        """Build the draft's runner with pools of `num_blocks` blocks of `block_size`
        positions: the target's cache's count, indexed by its block tables."""
        from .runner import ModelRunner

        self.runner = ModelRunner(self.model, 1, self.max_len, block_size,
                                  compile=self.compile, num_blocks=num_blocks)
        self.block_size = block_size

    @property
    def cache_bytes(self) -> int:
        """Bytes of the draft's pools on this rank (0 before `attach`)."""
        return 0 if self.runner is None else self.runner.cache_bytes

    def release(self, request_id: str) -> None:
        self.cached.pop(request_id, None)

    def _tables(self, batch, length: int) -> torch.Tensor:
        """`[b, ceil(length / block_size)]` block tables of the requests of `batch` (the
        target's); positions past a request's blocks (padding of a longer row, drafts past
        what it may emit) go to the null block 0."""
        return block_tables([r.blocks for r in batch], -(-length // self.block_size))

    def propose(self, batch, streams: list[list[int]], k: int, wanted: list[int]
                ) -> list[list[int]]:
        """`k` drafts per row of `batch` (requests, with `streams`: their prompt + output),
        identical on every rank. Row i's first `wanted[i]` drafts are `draw`n with its
        request's parameters and seed at its output positions (the keys the target's
        verification uses), the rest (padding, never verified) are the draft's argmax. The
        first pass feeds each row's tokens the draft has not seen, right-padded; the next
        k - 1 one token each."""
        from .comm import broadcast_tokens

        b = len(batch)
        start = [self.cached.get(r.id, 0) for r in batch]
        feed = [s[c:] for s, c in zip(streams, start)]
        starts = torch.tensor(start)
        drafts = torch.zeros(b, k, dtype=torch.int64)
        for j in range(k):
            if j == 0:
                logits = self._first_pass(batch, feed, start)
            else:  # the draft just made, one token per row
                starts = starts + torch.tensor([len(f) for f in feed]) if j == 1 else starts + 1
                logits = pipeline_forward(self.runner, drafts[:, j - 1:j].clone(),
                                          self._tables(batch, int(starts.max()) + 1), starts,
                                          torch.zeros(b, dtype=torch.int64))
            picked = None
            if logits is not None:
                picked, logits = logits.float().argmax(dim=-1), logits.float()
                for i, r in enumerate(batch):
                    if r.params.temperature != 0 and j < wanted[i]:
                        picked[i] = draw(filtered_probs(logits[i], r.params), r.seed,
                                         len(r.output) + j)
            drafts[:, j] = broadcast_tokens(picked, b)
        for i, r in enumerate(batch):  # the cache holds the stream and drafts 1..k-1
            self.cached[r.id] = len(streams[i]) + k - 1
        return drafts.tolist()

    def _first_pass(self, batch, feed: list[list[int]], start: list[int]
                    ) -> torch.Tensor | None:
        """The draft's logits `[b, V]` (last stage) at the last of each row's `feed` tokens,
        written from position `start[i]`: one right-padded forward, or one per row when the
        padding would reach past --max-model-len (a row near the end beside one catching up
        a long stream)."""
        width = max(map(len, feed))
        if max(start) + width > self.max_len:
            out = [self._first_pass([r], [f], [c]) for r, f, c in zip(batch, feed, start)]
            return None if out[0] is None else torch.cat(out)
        ids = torch.zeros(len(feed), width, dtype=torch.int64)
        for i, f in enumerate(feed):
            ids[i, :len(f)] = torch.tensor(f)
        return pipeline_forward(self.runner, ids, self._tables(batch, max(start) + width),
                                torch.tensor(start), torch.tensor([len(f) - 1 for f in feed]))

    def rewind(self, request_id: str, stream_length: int, accepted: int, k: int) -> None:
        """After verification: of the drafts the cache holds (1..k-1), those accepted stay
        valid, so the cache holds `stream_length` (before the step) + min(accepted, k - 1)
        tokens of the request's new stream."""
        if request_id in self.cached:
            self.cached[request_id] = stream_length + min(accepted, k - 1)


class SpecDecoder:
    """The engine's side of speculative decoding: `plan` the drafts of a decode micro-batch
    at launch (the same on every rank), `verify` the target's logits of all its positions
    when it returns, `release` a request that ended. `stats` counts drafts and acceptances.

    Args:
        config: the checked `SpeculativeConfig`.
        draft: the `DraftModelProposer` (method "draft_model") or `MTPProposer` ("mtp"),
            else None.
    """

    def __init__(self, config: SpeculativeConfig, draft: DraftModelProposer | None = None):
        self.config = config.validate()
        if (config.method != "ngram") != (draft is not None):
            raise ValueError("methods 'draft_model' and 'mtp' run a proposer; 'ngram' none")
        self.k = config.num_speculative_tokens
        self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max) \
            if draft is None else None
        self.draft = draft
        self.stats = SpecStats()

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes per token position the draft model's KV pools add to every cache block on
        this rank (0 for n-gram drafts): the engine sizes its cache for both models."""
        return 0 if self.draft is None else self.draft.kv_bytes_per_token

    def attach(self, num_blocks: int, block_size: int) -> None:
        """Give the draft model pools of the target cache's `num_blocks` blocks of
        `block_size` positions (nothing for n-gram drafts)."""
        if self.draft is not None:
            self.draft.attach(num_blocks, block_size)

    def observe(self, flight) -> None:
        """After the target's forward of `flight` (MTP drafts keep its hidden states)."""
        if hasattr(self.draft, "observe"):
            self.draft.observe(flight)

    def micro_batches(self, encoder_decoder: bool, pp: int, asked: int | None,
                      default: int) -> int:
        """The micro-batches the engine keeps in flight (`default` unless): a draft model at
        pp > 1 runs its passes through the pipeline at launch, so one at a time (`asked` > 1
        is refused); MTP drafts run on the last stage alone, so as many as without drafts.
        Raises `ValueError` for an encoder-decoder target (T5)."""
        if encoder_decoder:
            raise ValueError("speculative decoding is for decoder-only models; this model "
                             "is an encoder-decoder (T5): drop the speculative flags")
        if self.draft is None or pp == 1 or self.config.method == "mtp":
            return default
        if asked is not None and asked > 1:
            raise ValueError(f"a speculative draft model at --pp {pp} runs one micro-batch "
                             f"at a time; drop --inference-micro-batches {asked} or use "
                             f"--speculative-method ngram")
        return 1

    def plan(self, batch, streams: list[list[int]], max_seq_length: int
             ) -> tuple[list[list[int]], torch.Tensor]:
        """`(drafts, padded)` of a decode micro-batch (`streams`: each request's prompt +
        output): row i's drafts to verify (k_i of them), and the same right-padded to the
        longest as `[b, k_b]` (the forward's extra positions; padding is never verified).
        k_i is at most `num_speculative_tokens` and the tokens the row may still emit less
        one (the step emits one of its own); every row's positions len - 1 .. len - 1 + k_b
        must stay before `max_seq_length`, which caps k_b for all rows of a batch holding a
        row that close to the end (fewer drafts, the same ids: module docstring). k_b = 0:
        a plain decode step."""
        room = min(max_seq_length - len(s) for s in streams)
        ks = [max(0, min(self.k, r.params.max_new_tokens - len(r.output) - 1, room))
              for r in batch]
        if self.draft is not None and max(ks):
            drafts = self.draft.propose(batch, streams, max(ks), ks)
            drafts = [d[:n] for d, n in zip(drafts, ks)]
        elif self.draft is None:
            drafts = [self.ngram.propose(s, n) for s, n in zip(streams, ks)]
        else:
            drafts = [[] for _ in batch]
        k = max(map(len, drafts))
        padded = torch.tensor([d + [s[-1]] * (k - len(d)) for d, s in zip(drafts, streams)],
                              dtype=torch.int64).view(len(batch), k)
        return drafts, padded

    def verify(self, batch, logits: torch.Tensor | None, drafts: list[list[int]],
               streams: list[list[int]]) -> tuple[list, dict]:
        """`(runs, logprobs)`: each row's emitted ids (1 to k_i + 1 for its k_i `drafts`),
        the same on every rank, computed on the last stage from `logits [b, k_b + 1, V]`
        (None elsewhere; row i reads its first k_i + 1) by `verify_row` and broadcast from
        there as one `[b, k_b + 2]` tensor (count, ids); and
        for the rows whose request asked, {request id: [(token, logprob, [(id, logprob)] x
        N)] per emitted id} (the raw model output at its position, as `Engine._sample`
        gives them; broadcast only on steps with such a row). Counts the step in `stats`
        (the drafts verified: a row's own, not the padding); tells the draft model what it
        keeps."""
        from .comm import broadcast_logprobs, broadcast_tokens
        from .sampling import token_logprobs, unpack_logprobs

        b, k = len(batch), max(map(len, drafts))
        packed = None
        if logits is not None:
            packed = torch.zeros(b, k + 2, dtype=torch.int64)
            for i, r in enumerate(batch):
                n = len(drafts[i])
                rows = logits[i, :n + 1]
                if r.matcher is not None:  # structured: each position's grammar mask
                    from .structured import apply_masks

                    masks = r.matcher.masks_for(drafts[i])
                    rows = apply_masks(rows.float().clone(), masks + [None] * (n + 1 - len(masks)))
                run = verify_row(rows, drafts[i], r.params, r.seed, len(r.output))
                packed[i, 0] = len(run)
                packed[i, 1:1 + len(run)] = torch.tensor(run)
        packed = broadcast_tokens(None if packed is None else packed.flatten(),
                                  b * (k + 2)).view(b, k + 2).tolist()
        runs = [row[1:1 + row[0]] for row in packed]
        for r, run, s, d in zip(batch, runs, streams, drafts):
            self.stats.add(len(d), len(run) - 1)
            if self.draft is not None:
                self.draft.rewind(r.id, len(s), len(run) - 1, k)
        asked = [i for i, r in enumerate(batch) if r.params.logprobs is not None]
        if not asked:
            return runs, {}
        top = max(batch[i].params.logprobs for i in asked)
        values = None
        if logits is not None:
            rows = torch.cat([logits[i, :len(runs[i])] for i in asked])
            ids = torch.tensor([t for i in asked for t in runs[i]])
            values = token_logprobs(rows, ids, top)
        values = iter(broadcast_logprobs(values, sum(len(runs[i]) for i in asked), top).tolist())
        return runs, {batch[i].id: [unpack_logprobs(next(values), t, batch[i].params.logprobs)
                                    for t in runs[i]] for i in asked}

    def release(self, request_id: str) -> None:
        if self.draft is not None:
            self.draft.release(request_id)


def same_tokenizer(a, b) -> str | None:
    """None when tokenizers `a` and `b` (models/tokenizer.py) map every id to the same bytes
    with the same end-of-document id, else what differs."""
    if a.vocab_size != b.vocab_size:
        return f"{a.vocab_size} vs {b.vocab_size} tokens"
    if a.eod != b.eod:
        return f"end-of-document id {a.eod} vs {b.eod}"
    for i in range(a.vocab_size):
        if a.token_bytes(i) != b.token_bytes(i):
            return f"token {i} is {a.token_bytes(i)!r} vs {b.token_bytes(i)!r}"
    return None


def build_speculative(config: SpeculativeConfig, target, tokenizer, *, max_seq_length: int,
                      dtype: str = "float32", compile: bool = False,
                      quantization=None, mla_latent_cache: bool = True) -> SpecDecoder:
    """The `SpecDecoder` of `config` for the `target` model stage (infer.py): for a draft
    model, its stage on the current grid, loaded from `config.model` (a .gguf file or a
    folder with config.json: Hugging Face; else a native checkpoint) in `dtype`.

    Raises `ValueError` (also for the loader's errors) when the configuration is bad, the
    target is an encoder-decoder, or the draft's vocabulary or tokenizer is not the
    target's. `compile`: the draft model's layers are compiled too
    (`runner.compile_for_inference`). `quantization` (layers/quantized.py `Quantization`,
    infer.py's --quantization): how a Hugging Face draft's weights load, as the target's;
    a native checkpoint draft is served in float. `mla_latent_cache`: method "mtp" caches
    its MLA layer's latents (else full K/V), as the engine's cache does."""
    import os

    config.validate()
    if getattr(target.config, "is_encoder_decoder", False):
        raise ValueError("speculative decoding is for decoder-only models; this model is an "
                         "encoder-decoder (T5): drop the speculative flags")
    if config.method == "ngram":
        return SpecDecoder(config)
    if config.method == "mtp":
        from .mtp_draft import MTPProposer

        return SpecDecoder(config, MTPProposer(target, max_seq_length, mla_latent_cache))
    from .loading import load

    path = config.model
    hf = path.endswith(".gguf") or os.path.isfile(os.path.join(path, "config.json"))
    draft, draft_tokenizer, _ = load(hf=path, dtype=dtype, quantization=quantization) if hf \
        else load(load=path, dtype=dtype)
    if tokenizer is not None and draft_tokenizer is not None:
        differs = same_tokenizer(tokenizer, draft_tokenizer)
        if differs is not None:
            raise ValueError(f"the speculative model's tokenizer is not the target's "
                             f"({differs}); use a draft trained with the target's tokenizer")
    return SpecDecoder(config, DraftModelProposer(draft, target.config, max_seq_length,
                                                  compile))
