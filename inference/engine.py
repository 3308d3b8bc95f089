"""The generation engine of one model replica: a model runner (one forward over this
replica's tp x pp ranks with the KV cache) and an iteration-level scheduler (which requests
run this step).

Every rank of a replica runs the same `Engine` with the same inputs and takes the same
decisions: the only value that differs between ranks, the sampled ids, is broadcast from the
last pipeline stage each step (inference/comm.py), so the ranks stay in lockstep without a
coordinator.

Scheduling (Yu et al. 2022, Orca, "iteration-level scheduling"): each `step()` either
prefills the waiting requests that fit the free cache slots (they join the running batch) or
runs one decode step of every running request. A request leaves as soon as it finishes (EOS,
a stop string, max_new_tokens, or cancel) and its slot is reused at the next step.

Rows of one forward sit at different positions: prefill right-pads the prompts (each row
writes its tokens at 0..n-1 and reads its logits at n-1), decode feeds one token per row at
that row's own position; the attention mask `key position <= query position` is the same in
both, and cache entries past a row's length are never read.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

import parallel_state as ps
from parallel_state import p2p

from .comm import broadcast_tokens
from .kv_cache import KVCache
from .sampling import SamplingParams, sample


class ModelRunner:
    """Runs this rank's model chunk for a batch of rows over the pipeline.

    `step(ids [b, s], slots [b], starts [b], last [b], sampler)` -> next ids `[b]` int64 on
    every rank of the replica. Row i's tokens go to positions `starts[i] + 0..s-1`; the
    logits of token `last[i]` (gathered over the vocab-parallel head, cut to the real
    vocabulary: padding ids can never be produced) are passed as `[b, vocab]` to
    `sampler(logits)` on the last stage only.
    """

    def __init__(self, model, max_batch_size: int, max_seq_length: int):
        self.model = model.eval()
        self.config = model.config
        attn = next(iter(model.decoder.layers.values())).self_attention
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.cache = KVCache(model.layer_numbers, max_batch_size, max_seq_length,
                             attn.num_groups, attn.head_dim, self.dtype, self.device)
        self.first, self.last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()

    @torch.no_grad()
    def step(self, ids: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor,
             last: torch.Tensor, sampler) -> torch.Tensor:
        b, s = ids.shape
        dev = self.device
        positions = (starts[:, None] + torch.arange(s)[None, :]).to(dev)  # [b, s]
        length = int(positions.max()) + 1
        mask = torch.arange(length, device=dev)[None, None, :] <= positions[:, :, None]
        self.cache.bind(slots.to(dev), positions)
        spec = p2p.TensorSpec(((s, b, self.config.hidden_size),), self.dtype, dev)
        hidden = None if self.first else p2p.recv_forward(spec)[0]
        out = self.model(ids.to(dev) if self.first else None, position_ids=positions,
                         hidden_states=hidden, kv_cache=self.cache,
                         attention_mask=mask[:, None])
        if not self.last:
            p2p.send_forward(spec, (out,))
            return broadcast_tokens(None, b)
        local = out[torch.arange(b, device=dev), last.to(dev)]  # [b, v_padded / tp]
        logits = ps.gather_from_tensor_model_parallel_region(local)[:, :self.config.vocab_size]
        return broadcast_tokens(sampler(logits), b)


@dataclass
class Request:
    """One generation request and its progress (`finish_reason`: "stop", "length",
    "cancelled"; None while running)."""

    id: str
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    text: str = ""  # decoded output so far (stop strings cut off)
    sent: int = 0  # characters of `text` already handed out by `step` events
    finish_reason: str | None = None
    slot: int | None = None
    generator: torch.Generator | None = None


@dataclass
class Event:
    """What `Engine.step` reports for a request: new ids, new text, finished or not."""

    id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


class Engine:
    """Continuous-batching generation over one replica (see the module docstring).

    Args:
        model: this rank's `GPTModel` chunk (one chunk per rank: no virtual pipeline).
        eos_token_ids: ids that end a request (unless `ignore_eos`).
        decode: `ids -> text` (the tokenizer's), for stop strings and text events; None =
            no text.
        max_batch_size: KV cache slots (requests running at once).
        max_seq_length: prompt + generated tokens of one request at most.
        max_prefill_tokens: padded prompt tokens admitted in one prefill step.
    """

    def __init__(self, model, *, eos_token_ids=(), decode=None, max_batch_size: int = 8,
                 max_seq_length: int = 2048, max_prefill_tokens: int = 8192):
        self.runner = ModelRunner(model, max_batch_size, max_seq_length)
        self.eos = set(int(e) for e in eos_token_ids)
        self.decode = decode
        self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length
        self.max_prefill_tokens = max(max_prefill_tokens, max_seq_length)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.free_slots = list(range(max_batch_size))

    # ------------------------------------------------------------------ requests
    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise `ValueError` (`SamplingError` for a sampling field) if the request cannot run."""
        params.validate()
        if not prompt:
            raise ValueError("the prompt is empty; send at least one token")
        vocab = self.runner.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt) + params.max_new_tokens > self.max_seq_length:
            raise ValueError(
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_new_tokens}) "
                f"exceeds the context of {self.max_seq_length} tokens; shorten the prompt or "
                f"lower max_tokens")

    def add(self, request: Request) -> None:
        """Queue `request` (checked with `check`); it joins the batch at the next step."""
        self.check(request.prompt, request.params)
        seed = request.params.seed
        request.generator = torch.Generator().manual_seed(
            seed if seed is not None else int(torch.randint(0, 2**62, ())))
        self.waiting.append(request)

    def cancel(self, request_id: str) -> Request | None:
        """Stop a request now (finish_reason "cancelled"); its slot is free at once."""
        for queue in (self.waiting, self.running):
            for r in queue:
                if r.id == request_id:
                    self._finish(r, "cancelled")
                    return r
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def load(self) -> int:
        """Tokens still to generate, at most (the router's measure of work)."""
        return sum(r.params.max_new_tokens - len(r.output) for r in self.waiting + self.running)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[Event]:
        """One iteration: a prefill of newly admitted requests, else a decode of all running."""
        batch = self._admit()
        if batch:
            n = [len(r.prompt) for r in batch]
            ids = torch.zeros(len(batch), max(n), dtype=torch.int64)
            for i, r in enumerate(batch):
                ids[i, :n[i]] = torch.tensor(r.prompt)
            starts = torch.zeros(len(batch), dtype=torch.int64)
            last = torch.tensor(n) - 1
        elif self.running:
            batch = list(self.running)
            ids = torch.tensor([[r.output[-1]] for r in batch])
            starts = torch.tensor([len(r.prompt) + len(r.output) - 1 for r in batch])
            last = torch.zeros(len(batch), dtype=torch.int64)
        else:
            return []
        slots = torch.tensor([r.slot for r in batch])
        tokens = self.runner.step(ids, slots, starts, last, lambda logits: sample(
            logits, [r.params for r in batch], [r.generator for r in batch]))
        return [self._append(r, int(t)) for r, t in zip(batch, tokens.tolist())]

    def generate(self, requests: list[Request]) -> list[Request]:
        """Run `requests` to completion (continuous batching when they outnumber the slots)."""
        for r in requests:
            self.add(r)
        while self.has_work():
            self.step()
        return requests

    def _admit(self) -> list[Request]:
        batch = []
        while self.waiting and self.free_slots:
            r = self.waiting[0]
            longest = max([len(r.prompt)] + [len(q.prompt) for q in batch])
            if batch and longest * (len(batch) + 1) > self.max_prefill_tokens:
                break
            self.waiting.pop(0)
            r.slot = self.free_slots.pop(0)
            batch.append(r)
        self.running.extend(batch)
        return batch

    def _append(self, r: Request, token: int) -> Event:
        r.output.append(token)
        reason = None
        if token in self.eos and not r.params.ignore_eos:
            reason = "stop"
        elif len(r.output) >= r.params.max_new_tokens:
            reason = "length"
        if self.decode is not None:
            text = self.decode(r.output)
            for s in r.params.stop:
                cut = text.find(s)
                if cut >= 0:
                    text, reason = text[:cut], "stop"
            r.text = text
        if reason is not None:
            self._finish(r, reason)
        return Event(r.id, [token], self._new_text(r), r.finish_reason, len(r.prompt),
                     len(r.output))

    def _new_text(self, r: Request) -> str:
        """Text not yet handed out; while running, hold back an incomplete UTF-8 character
        and any tail that may still become a stop string."""
        end = len(r.text)
        if r.finish_reason is None:
            if r.text.endswith("\ufffd"):
                end -= 1
            for s in r.params.stop:
                for k in range(min(len(s) - 1, end), 0, -1):
                    if r.text[:end].endswith(s[:k]):
                        end -= k
                        break
        new, r.sent = r.text[r.sent:end], max(r.sent, end)
        return new

    def _finish(self, r: Request, reason: str) -> None:
        r.finish_reason = reason
        if r in self.waiting:
            self.waiting.remove(r)
        if r in self.running:
            self.running.remove(r)
            self.free_slots.append(r.slot)
            self.free_slots.sort()
        r.slot = None
