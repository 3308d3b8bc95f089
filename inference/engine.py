"""The generation engine of one model replica: a model runner (one forward over this
replica's tp x pp ranks with the KV cache) and an iteration-level scheduler (which requests
run this step).

Every rank of a replica runs the same `Engine` with the same inputs and takes the same
decisions: the only value that differs between ranks, the sampled ids, is broadcast from the
last pipeline stage each step (inference/comm.py; with the log-probabilities of the rows that
asked for them, on steps that have such rows), so the ranks stay in lockstep without a
coordinator.

Scheduling (Yu et al. 2022, Orca, "iteration-level scheduling"): each `step()` starts one
micro-batch: either a prefill of the waiting requests that fit the free cache slots (they join
the running batch) or one decode step of running requests. A request leaves as soon as it
finishes (EOS, a stop string, max_new_tokens, or cancel) and its slot is reused at the next
step.

Pipeline parallelism: a `step()` is one tick of the pipeline. Stage s runs the micro-batch
started s ticks ago while the first stage starts the next one, so with `num_micro_batches`
(default pp) micro-batches of disjoint requests in flight no stage waits for another between
tokens (the decode analogue of GPipe's micro-batches, Huang et al. 2019; vLLM runs pp
"virtual engines" the same way). All stages swap activations in one exchange per tick; the
ids of the micro-batch leaving the last stage go to every rank at the end of the tick, so its
requests can be scheduled again at the next one. A micro-batch holds at most
ceil(max_batch_size / num_micro_batches) rows.

Rows of one forward sit at different positions: prefill right-pads the prompts (each row
writes its tokens at 0..n-1 and reads its logits at n-1), decode feeds one token per row at
that row's own position; the attention mask `key position <= query position` is the same in
both, and cache entries past a row's length are never read. A model with sliding-window
layers gets a second mask that also hides keys more than `window_size[0]` positions back.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from parallel_state import p2p

from .comm import broadcast_logprobs, broadcast_tokens
from .detokenize import IncrementalDetokenizer
from .runner import ModelRunner
from .seq2seq import Seq2SeqRunner
from .sampling import SamplingParams, sample, token_logprobs, unpack_logprobs


@dataclass
class _Flight:
    """One micro-batch forward on its way through the pipeline (launched at tick `tick`)."""

    batch: list
    ids: torch.Tensor
    slots: torch.Tensor
    starts: torch.Tensor
    last: torch.Tensor
    tick: int
    sources: tuple | None = None  # encoder-decoder prefill: (prompts [b, se], lengths [b])


@dataclass(eq=False)  # requests compare by identity
class Request:
    """One generation request and its progress (`finish_reason`: "stop", "length",
    "cancelled"; None while running)."""

    id: str
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    text: str = ""  # decoded output so far, whole characters only (stop strings cut off)
    sent: int = 0  # characters of `text` already handed out by `step` events
    detokenizer: IncrementalDetokenizer | None = None
    arrival: float = 0.0  # time.monotonic() when `add` queued it
    queue_s: float | None = None  # seconds it waited for a slot (set at admission)
    ttft_s: float | None = None  # seconds from `add` to its first generated token
    finish_reason: str | None = None
    slot: int | None = None
    generator: torch.Generator | None = None


@dataclass
class Event:
    """What `Engine.step` reports for a request: new ids, new text, finished or not, and the
    new ids' log-probabilities when the request asked for them."""

    id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    # per token of `token_ids` when the request asked (SamplingParams.logprobs), else None:
    # (token id, logprob, [(id, logprob)] x N most likely, in decreasing probability)
    logprobs: list[tuple] | None = None
    queue_s: float | None = None  # on a request's first event: seconds it waited for a slot


class Engine:
    """Continuous-batching generation over one replica (see the module docstring).

    Args:
        model: this rank's `GPTModel` chunk (one chunk per rank: no virtual pipeline).
        eos_token_ids: ids that end a request (unless `ignore_eos`).
        decode: `ids -> text` (the tokenizer's), for stop strings and text events; None =
            no text.
        max_batch_size: KV cache slots (requests running at once).
        max_seq_length: prompt + generated tokens of one request at most (encoder-decoder:
            generated tokens at most).
        max_source_length: encoder-decoder: prompt (encoder input) tokens at most (default
            max_seq_length).
        max_prefill_tokens: padded prompt tokens admitted in one prefill step.
        num_micro_batches: micro-batches in flight through the pipeline at once, at most
            (default pp; 1 = one batch at a time). Each holds at most ceil(max_batch_size /
            num_micro_batches) rows.
    Raises `ValueError` for num_micro_batches < 1.
    """

    def __init__(self, model, *, eos_token_ids=(), decode=None, max_batch_size: int = 8,
                 max_seq_length: int = 2048, max_prefill_tokens: int = 8192,
                 num_micro_batches: int | None = None, max_source_length: int | None = None):
        self.encoder_decoder = getattr(model.config, "is_encoder_decoder", False)
        self.max_source_length = max_source_length or max_seq_length
        if self.encoder_decoder:  # T5: the prompt is the encoder input (inference/seq2seq.py)
            self.runner = Seq2SeqRunner(model, max_batch_size, max_seq_length,
                                        self.max_source_length)
        else:
            self.runner = ModelRunner(model, max_batch_size, max_seq_length)
        self.eos = set(int(e) for e in eos_token_ids)
        self.decode = decode
        self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length
        self.max_prefill_tokens = max(max_prefill_tokens, max_seq_length)
        m = self.runner.pp if num_micro_batches is None else num_micro_batches
        if m < 1:
            raise ValueError(f"num_micro_batches must be >= 1, got {m}")
        self.num_micro_batches = m
        self.micro_batch_size = -(-max_batch_size // m)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.free_slots = list(range(max_batch_size))
        self.tick = 0  # pipeline ticks (`step` calls) so far
        self.in_flight: dict[int, _Flight] = {}  # launch tick -> micro-batch
        self.busy: set[str] = set()  # ids of requests whose micro-batch is in flight
        self.max_in_flight = 0  # most micro-batches in flight at once (statistics)
        self._received: tuple | None = None  # this stage's input for the next tick

    # ------------------------------------------------------------------ requests
    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise `ValueError` (`SamplingError` for a sampling field) if the request cannot run."""
        params.validate()
        if not prompt:
            raise ValueError("the prompt is empty; send at least one token")
        vocab = self.runner.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if self.encoder_decoder:
            if len(prompt) > self.max_source_length:
                raise ValueError(f"the prompt ({len(prompt)} tokens) is longer than the "
                                 f"encoder's {self.max_source_length} tokens; shorten it")
            if params.max_new_tokens > self.max_seq_length:
                raise ValueError(f"max_tokens ({params.max_new_tokens}) exceeds the decoder's "
                                 f"{self.max_seq_length} tokens; lower max_tokens")
        elif len(prompt) + params.max_new_tokens > self.max_seq_length:
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
        request.arrival = time.monotonic()
        self.waiting.append(request)

    def cancel(self, request_id: str) -> Request | None:
        """Stop a request now (finish_reason "cancelled"); its slot is free once no
        micro-batch holding it is in flight."""
        for queue in (self.waiting, self.running):
            for r in queue:
                if r.id == request_id:
                    self._finish(r, "cancelled")
                    return r
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.in_flight)

    def stats(self) -> dict:
        """Requests running and waiting, and the fraction of KV cache slots held (0-1)."""
        return {"running": len(self.running), "waiting": len(self.waiting),
                "kv_cache_usage": 1 - len(self.free_slots) / self.max_batch_size}

    def load(self) -> int:
        """Tokens still to generate, at most (the router's measure of work)."""
        return sum(r.params.max_new_tokens - len(r.output) for r in self.waiting + self.running)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[Event]:
        """One pipeline tick (with pp = 1: one forward of the replica).

        The first stage starts a micro-batch: a prefill of newly admitted requests, else a
        decode of running requests not already in flight. Every stage runs the micro-batch
        that reached it (stage s: the one started s ticks ago), then passes its output on;
        the last stage samples, and the micro-batch started pp - 1 ticks ago returns its ids
        to every rank. With `num_micro_batches` >= pp the stages never wait for each other
        between tokens. Returns the events of the returned micro-batch (none while the
        pipeline fills)."""
        runner, t = self.runner, self.tick
        flight = self._launch(t)
        if flight is not None:
            self.in_flight[t] = flight
            self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        mine = self.in_flight.get(t - runner.stage)
        out = None
        if mine is not None:
            hidden, self._received = self._received, None
            extra = {"sources": mine.sources} if self.encoder_decoder else {}
            out = runner.forward(mine.ids, mine.slots, mine.starts, mine.last, hidden, **extra)
        if runner.pp > 1:  # hand the output on, take the next tick's input
            ahead = self.in_flight.get(t + 1 - runner.stage)
            spec = runner.incoming(ahead) if ahead is not None else None
            send = runner.outgoing(out, mine) if mine is not None else None
            if send is not None or spec is not None:
                got = p2p.communicate(spec or p2p.TensorSpec((), runner.dtype, runner.device),
                                      send_next=send, recv_prev=spec is not None)[0]
                self._received = got
        done = self.in_flight.pop(t - runner.pp + 1, None)
        self.tick += 1
        if done is None:
            return []
        tokens, logprobs = self._sample(done, out if mine is done and runner.last else None)
        events = []
        for r, tok in zip(done.batch, tokens.tolist()):
            self.busy.discard(r.id)
            if r.finish_reason is not None:  # cancelled while in flight: free its slot now
                self._release(r)
                continue
            event = self._append(r, int(tok))
            if r.id in logprobs:
                event.logprobs = [logprobs[r.id]]
            events.append(event)
        return events

    def _sample(self, done: _Flight, logits: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
        """The next ids `[b]` of `done`'s rows on every rank of the replica, sampled from
        `logits [b, V]` (given on the last stage's ranks, None elsewhere), and for the rows
        whose request asked for log-probabilities {request id: (token, logprob, [(id,
        logprob)] x N)} (inference/sampling.py `token_logprobs`: the raw model output). Only
        those rows are computed, and only steps with such a row broadcast them."""
        batch = done.batch
        asked = [i for i, r in enumerate(batch) if r.params.logprobs is not None]
        k = max((batch[i].params.logprobs for i in asked), default=0)
        tokens = values = None
        if logits is not None:
            tokens = sample(logits, [r.params for r in batch], [r.generator for r in batch])
            if asked:
                rows = torch.tensor(asked, device=logits.device)
                values = token_logprobs(logits[rows], tokens[rows], k)
        tokens = broadcast_tokens(tokens, len(batch))
        if not asked:
            return tokens, {}
        values, ids = broadcast_logprobs(values, len(asked), k).tolist(), tokens.tolist()
        return tokens, {batch[i].id: unpack_logprobs(row, ids[i], batch[i].params.logprobs)
                        for i, row in zip(asked, values)}

    def generate(self, requests: list[Request]) -> list[Request]:
        """Run `requests` to completion (continuous batching when they outnumber the slots)."""
        for r in requests:
            self.add(r)
        while self.has_work():
            self.step()
        return requests

    def _launch(self, tick: int) -> _Flight | None:
        """The micro-batch the first stage starts at `tick` (the same on every rank)."""
        if len(self.in_flight) >= self.num_micro_batches:
            return None
        batch = self._admit()
        sources = None
        if batch:
            n = [len(r.prompt) for r in batch]
            ids = torch.zeros(len(batch), max(n), dtype=torch.int64)
            for i, r in enumerate(batch):
                ids[i, :n[i]] = torch.tensor(r.prompt)
            starts = torch.zeros(len(batch), dtype=torch.int64)
            last = torch.tensor(n) - 1
            if self.encoder_decoder:  # encode the prompts; decode from the start id 0
                sources = (ids, torch.tensor(n))
                ids, last = torch.zeros(len(batch), 1, dtype=torch.int64), starts.clone()
        else:
            batch = [r for r in self.running if r.id not in self.busy][:self.micro_batch_size]
            if not batch:
                return None
            ids = torch.tensor([[r.output[-1]] for r in batch])
            starts = torch.tensor([len(r.output) + (0 if self.encoder_decoder else
                                                    len(r.prompt) - 1) for r in batch])
            last = torch.zeros(len(batch), dtype=torch.int64)
        self.busy.update(r.id for r in batch)
        # the micro-batch decoded longest ago goes first next time (fair rotation)
        self.running = [r for r in self.running if r not in batch] + batch
        return _Flight(batch, ids, torch.tensor([r.slot for r in batch]), starts, last, tick,
                       sources)

    def _admit(self) -> list[Request]:
        batch = []
        while self.waiting and self.free_slots and len(batch) < self.micro_batch_size:
            r = self.waiting[0]
            longest = max([len(r.prompt)] + [len(q.prompt) for q in batch])
            if batch and longest * (len(batch) + 1) > self.max_prefill_tokens:
                break
            self.waiting.pop(0)
            r.slot = self.free_slots.pop(0)
            r.queue_s = time.monotonic() - r.arrival
            batch.append(r)
        self.running.extend(batch)
        return batch

    def _append(self, r: Request, token: int) -> Event:
        r.output.append(token)
        if r.ttft_s is None:
            r.ttft_s = time.monotonic() - r.arrival
        reason = None
        if token in self.eos and not r.params.ignore_eos:
            reason = "stop"
        elif len(r.output) >= r.params.max_new_tokens:
            reason = "length"
        if self.decode is not None:
            reason = self._extend_text(r, token, reason)
        if reason is not None:
            self._finish(r, reason)
        return Event(r.id, [token], self._new_text(r), r.finish_reason, len(r.prompt),
                     len(r.output), queue_s=r.queue_s if len(r.output) == 1 else None)

    def _extend_text(self, r: Request, token: int, reason: str | None) -> str | None:
        """Add `token`'s text to `r.text` (inference/detokenize.py: whole characters only;
        all that is left once the request ends), cut it at the first stop string, and return
        the finish reason ("stop" when a stop string appeared)."""
        if r.detokenizer is None:  # the prompt is the first tokens' context (not for T5)
            r.detokenizer = IncrementalDetokenizer(
                self.decode, () if self.encoder_decoder else r.prompt)
        piece = r.detokenizer.add(token)
        if reason is not None:
            piece += r.detokenizer.finish()
        if not piece:
            return reason
        r.text += piece
        if r.params.stop:  # a new match starts at most len(stop) - 1 characters back
            lo = max(0, len(r.text) - len(piece) - max(map(len, r.params.stop)) + 1)
            cuts = [c for c in (r.text.find(s, lo) for s in r.params.stop) if c >= 0]
            if cuts:
                r.text, reason = r.text[:min(cuts)], "stop"
        return reason

    def _new_text(self, r: Request) -> str:
        """Text not yet handed out; while running, hold back any tail that may still become
        a stop string."""
        end = len(r.text)
        if r.finish_reason is None:
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
            if r.id not in self.busy:  # else freed when its micro-batch returns
                self._release(r)

    def _release(self, r: Request) -> None:
        if r.slot is not None:
            self.free_slots.append(r.slot)
            self.free_slots.sort()
        r.slot = None
