"""The generation engine of one model replica: a model runner (one forward over this
replica's tp x pp ranks with the KV cache) and an iteration-level scheduler (which requests
run this step).

Every rank of a replica runs the same `Engine` with the same inputs and takes the same
decisions (admission, block tables, preemption, prefix-cache hits: inference/block_manager.py
is deterministic): the only value that differs between ranks, the sampled ids, is broadcast
from the last pipeline stage each step (inference/comm.py; with the log-probabilities of the
rows that asked for them, on steps that have such rows), so the ranks stay in lockstep
without a coordinator.

Scheduling (Yu et al. 2022, Orca, "iteration-level scheduling"): each `step()` starts one
micro-batch: either a prefill (prompt chunks of running requests not yet prefilled, then
waiting requests admitted first come, first served while their blocks fit) or one decode
step of running requests. When both are pending they alternate, so a running request waits
at most one prefill of at most `max_num_batched_tokens` tokens between two of its tokens
(chunked prefill, Agrawal et al. 2023, Sarathi; vLLM's --max-num-batched-tokens): a longer
prompt is prefilled in chunks, each starting where the cache ends. The one exception is a
burst of arrivals: a second prefill may follow the first when it admits more requests than
the decode would advance, so a decode waits at most two prefills (scheduler.py
`_may_prefill`). A request leaves as soon as it finishes (EOS, a stop string,
max_new_tokens, or cancel) and its blocks are freed.

KV cache (decoder-only models): blocks of `block_size` positions (PagedKVCache); a request
holds the blocks of the positions it has computed. With prefix caching a new request first
takes the cached full blocks its tokens start with and prefills only the rest. When a
request needs a block and none is free, the running request that arrived last (possibly
the one asking) is preempted by recomputation (vLLM's default): its blocks are freed, and it
goes back to the waiting queue in its arrival order, with prompt + output so far as its
prompt, to be admitted again once a running request has left (scheduler.py `_preempt`);
what it generated stays generated. The request that arrived first is never preempted by a
later one, so the batch always progresses; a request that cannot fit the whole cache alone is refused by
`check`. T5 (inference/seq2seq.py) keeps a contiguous slot per request: one "block" of
max_seq_length positions, no prefix caching and no chunking (its prompt is the encoder's).

Pipeline parallelism: a `step()` is one tick of the pipeline. Stage s runs the micro-batch
started s ticks ago while the first stage starts the next one, so with `num_micro_batches`
(default pp) micro-batches of disjoint requests in flight no stage waits for another between
tokens (the decode analogue of GPipe's micro-batches, Huang et al. 2019; vLLM runs pp
"virtual engines" the same way). All stages swap activations in one exchange per tick; the
ids of the micro-batch leaving the last stage go to every rank at the end of the tick, so its
requests can be scheduled again at the next one. A micro-batch holds at most
ceil(max_batch_size / num_micro_batches) rows. A request in flight is never preempted and
its blocks are freed (when cancelled) only once its micro-batch has returned, so no stage
writes into a block after it changed hands; a block named for the prefix cache at launch is
written by every stage before any later micro-batch reads it there.

Rows of one forward sit at different positions: prefill right-pads the chunks (row i writes
its tokens at starts[i]..starts[i]+n-1 and reads its logits at the last), decode feeds one
token per row at that row's own position; the attention mask `key position <= query
position` is the same in both, and cache entries past a row's length are never read. A
model with sliding-window layers gets a second mask that also hides keys more than
`window_size[0]` positions back.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from parallel_state import p2p

from .block_manager import BlockManager
from .comm import broadcast_logprobs, broadcast_prompt_logprobs, broadcast_tokens
from .detokenize import OutputText
from .limits import RequestLimits
from .runner import ModelRunner, kv_bytes_per_token
from .scheduler import Scheduler, _Flight
from .seq2seq import Seq2SeqRunner
from .sampling import (SamplingParams, prompt_token_logprobs, sample, token_logprobs,
                       unpack_logprobs, unpack_prompt_logprobs)


@dataclass(eq=False)  # requests compare by identity
class Request:
    """One generation request and its progress (`finish_reason`: "stop", "length",
    "cancelled"; None while running)."""

    id: str
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    # its text (inference/detokenize.py) when the engine decodes (offline generation)
    out: OutputText | None = None
    arrival: float = 0.0  # time.monotonic() when `add` queued it
    queue_s: float | None = None  # seconds it waited for a slot (set at admission)
    ttft_s: float | None = None  # seconds from `add` to its first generated token
    finish_reason: str | None = None
    seed: int = 0  # keys its sampled draws: params.seed, or random when unset (set by `add`)
    # KV cache state: the block table, positions computed (or being computed by a launched
    # forward), names of its full blocks (prefix caching) and how many of them are named in
    # the cache, and its place in first-come-first-served order (preemption, admission)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    hashes: list[bytes] = field(default_factory=list)
    num_registered: int = 0
    seq: int = 0
    preemptions: int = 0
    left_before: int = 0  # engine.num_left when it was last preempted
    matcher: object = None  # structured outputs: its grammar's `structured.Matcher`
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)
    lora_slot: int = 0  # its adapter's slot (inference/lora.py; 0: the base), set by `add`
    cache_salt: bytes | None = None  # roots its prefix-cache block names (its adapter's)
    # params.prompt_logprobs: prompt tokens 1, 2, ... scored so far, each `(id, logprob,
    # rank, [(id, logprob)] x N)` (inference/sampling.py `unpack_prompt_logprobs`)
    prompt_lps: list = field(default_factory=list)

    @property
    def text(self) -> str:
        """Decoded output so far, whole characters only (stop strings cut off); "" when the
        engine does not decode."""
        return self.out.text if self.out is not None else ""


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
    preemptions: int | None = None  # on its last event: times it was preempted
    # on its first event when it asked (SamplingParams.prompt_logprobs): per prompt token,
    # None for the first, then `(id, logprob, rank, [(id, logprob)] x N)`
    prompt_logprobs: list | None = None


class Engine(Scheduler):
    """Continuous-batching generation over one replica (see the module docstring).

    Args:
        model: this rank's `GPTModel` chunk (one chunk per rank: no virtual pipeline).
        eos_token_ids: ids that end a request (unless `ignore_eos`).
        decode: `ids -> text` (the tokenizer's), for stop strings and text events; None =
            no text.
        max_batch_size: requests running at once, at most (vLLM's max_num_seqs).
        max_seq_length: prompt + generated tokens of one request at most (encoder-decoder:
            generated tokens at most).
        max_source_length: encoder-decoder: prompt (encoder input) tokens at most (default
            max_seq_length).
        max_num_batched_tokens: padded prompt tokens in one prefill forward, at most; a
            longer prompt is prefilled in chunks of this size (T5: padded encoder tokens,
            prompts never chunked). Default 2048.
        num_micro_batches: micro-batches in flight through the pipeline at once, at most
            (default pp; 1 = one batch at a time). Each holds at most ceil(max_batch_size /
            num_micro_batches) rows.
        block_size: token positions per KV cache block (--kv-block-size).
        kv_cache_memory: the cache's size on each rank, bytes (int) or a fraction of the
            memory the rank may still allocate (float), a speculative draft model's pools
            included (they share the blocks); default max_batch_size requests of
            max_seq_length tokens (`ModelRunner`).
        enable_prefix_caching: share the cached full blocks a prompt starts with.
        speculative: an `inference.spec_decode.SpecDecoder`: decode steps verify drafted
            tokens (decoder-only models; a draft model at pp > 1 runs one micro-batch at a
            time); None = one token per step.
        compile: `torch.compile` the model's layers (`runner.compile_for_inference`;
            decoder-only models).
        grammar: an `inference.structured.GrammarBackend` for requests with a grammar
            (`SamplingParams.grammar`); None = such requests are refused by `check`. Their
            masks are computed on the last stage in a worker thread while the forward runs.
        lora: an `inference.lora.LoRAManager` (infer.py --enable-lora): a request's
            `lora_name` picks its adapter; rows of different adapters share a forward.
        mla_latent_cache: a multi-head latent attention model (DeepSeek-V3) caches its
            compressed latents (default), not full K/V (layers/mla.py; `runner.
            kv_cache_geometry`); infer.py --mla-full-kv-cache turns it off.
    Raises `ValueError` for num_micro_batches, block_size or max_num_batched_tokens < 1, a
    cache too small to hold one block, or `compile` with an encoder-decoder model.
    """

    def __init__(self, model, *, eos_token_ids=(), decode=None, max_batch_size: int = 8,
                 max_seq_length: int = 2048, max_num_batched_tokens: int | None = None,
                 num_micro_batches: int | None = None, max_source_length: int | None = None,
                 block_size: int = 16, kv_cache_memory: int | float | None = None,
                 enable_prefix_caching: bool = True, speculative=None, compile: bool = False,
                 grammar=None, lora=None, mla_latent_cache: bool = True):
        self.encoder_decoder = getattr(model.config, "is_encoder_decoder", False)
        self.max_source_length = max_source_length or max_seq_length
        budget = 2048 if max_num_batched_tokens is None else max_num_batched_tokens
        if budget < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {budget}")
        if self.encoder_decoder:  # T5: the prompt is the encoder input (inference/seq2seq.py)
            self.runner = Seq2SeqRunner(model, max_batch_size, max_seq_length,
                                        self.max_source_length, compile=compile)
            # one block per request: the slot of the contiguous cache
            self.blocks = BlockManager(max_batch_size, max_seq_length, False, first_block=0)
            budget = max(budget, self.max_source_length)  # prompts are not chunked
        else:  # a draft model's pools share the blocks (and the memory): sized for both
            self.runner = ModelRunner(
                model, max_batch_size, max_seq_length, block_size, kv_cache_memory,
                compile=compile, shared_bytes_per_token=speculative.kv_bytes_per_token
                if speculative is not None else 0, mla_latent_cache=mla_latent_cache)
            if speculative is not None:
                speculative.attach(self.runner.cache.num_blocks, block_size)
            self.blocks = BlockManager(self.runner.cache.num_blocks, block_size,
                                       enable_prefix_caching,
                                       region_blocks=-(-max_seq_length // block_size))
        if lora is not None and (self.encoder_decoder or speculative is not None):
            raise ValueError("--enable-lora serves decoder-only models without speculative "
                             "decoding; drop --enable-lora or --speculative-config")
        self.lora = lora
        self.eos = set(int(e) for e in eos_token_ids)
        self.decode = decode
        self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length
        self.max_num_batched_tokens = budget
        self.spec = speculative
        self.grammar = grammar
        self._masks: dict = {}  # launch tick -> future of its sampled rows' grammar masks
        self._mask_pool = None  # one worker thread, started by the first grammar row
        m = self.runner.pp if num_micro_batches is None else num_micro_batches
        if speculative is not None:  # T5 refused; a draft model at pp > 1: one at a time
            m = speculative.micro_batches(self.encoder_decoder, self.runner.pp,
                                          num_micro_batches, m)
        if m < 1:
            raise ValueError(f"num_micro_batches must be >= 1, got {m}")
        self.num_micro_batches = m
        self.micro_batch_size = -(-max_batch_size // m)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.tick = 0  # pipeline ticks (`step` calls) so far
        self.in_flight: dict[int, _Flight] = {}  # launch tick -> micro-batch
        self.busy: set[str] = set()  # ids of requests whose micro-batch is in flight
        self.max_in_flight = 0  # most micro-batches in flight at once (statistics)
        self._received: tuple | None = None  # this stage's input for the next tick
        self._arrivals = 0  # requests added so far (their `seq`)
        self._prefills_in_a_row = 0  # prefill micro-batches started since the last decode
        # statistics (tokens looked up in / found in the prefix cache, preemptions)
        self.prefix_queries = self.prefix_hits = self.num_preemptions = 0
        self.num_left = 0  # running requests that finished or were cancelled so far
        # what a request may ask (plain data: the API server process checks with a copy)
        self.limits = RequestLimits(
            self.runner.config.vocab_size, max_seq_length, self.max_source_length,
            self.encoder_decoder, self.blocks.block_size, self.blocks.capacity,
            "this server has no tokenizer for structured outputs" if grammar is None
            else grammar.unavailable)

    def cache_summary(self) -> str:
        """One line for the start-up log: the cache's blocks, tokens and bytes on this rank."""
        bm, r = self.blocks, self.runner
        if self.encoder_decoder:
            return (f"KV cache: {bm.capacity} slots of {bm.block_size} decoder tokens "
                    f"(contiguous, T5)")
        tokens = bm.capacity * bm.block_size
        draft = self.spec.draft.cache_bytes if self.spec and self.spec.draft else 0
        per_token = r.bytes_per_token + (self.spec.kv_bytes_per_token if self.spec else 0)
        whose = "MTP layer" if self.spec and self.spec.config.method == "mtp" else "draft model"
        of_draft = f", {draft / 2**20:,.1f} MiB of it the {whose}'s" if draft else ""
        line = (f"KV cache: {bm.capacity:,} blocks of {bm.block_size} tokens = {tokens:,} "
                f"tokens ({(r.cache_bytes + draft) / 2**20:,.1f} MiB on this rank{of_draft}, "
                f"{per_token:,} bytes per token), prefix caching "
                f"{'on' if bm.enable_prefix_caching else 'off'}, prefill chunks of "
                f"{self.max_num_batched_tokens} tokens")
        if not r.cache.values:  # MLA's latents: the same model's full K/V for comparison
            full = kv_bytes_per_token(r.model, mla_latent_cache=False)
            line += (f"; multi-head latent attention caches kv_lora_rank + "
                     f"qk_rope_head_dim values per token and layer: "
                     f"{full / r.bytes_per_token:.1f}x fewer bytes than full K/V "
                     f"({full:,} bytes per token)")
        if tokens < self.max_seq_length:
            line += (f"; requests over {tokens} tokens will be refused (--max-model-len "
                     f"{self.max_seq_length}): raise --kv-cache-memory")
        return line

    # ------------------------------------------------------------------ requests
    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise `ValueError` (`SamplingError` for a sampling field) if the request cannot run
        (`RequestLimits.check` of `self.limits`)."""
        self.limits.check(prompt, params)

    def add(self, request: Request) -> None:
        """Queue `request` (checked with `check`); it joins the batch at the next step."""
        self.check(request.prompt, request.params)
        if request.lora_name is not None:
            if self.lora is None:
                raise ValueError(f"the model {request.lora_name!r} is a LoRA adapter, but "
                                 f"this server runs without --enable-lora")
            adapter = self.lora.get(request.lora_name)
            request.lora_slot = adapter.slot
            request.cache_salt = f"lora:{adapter.load_id}".encode()
        seed = request.params.seed
        request.seed = seed if seed is not None else int(torch.randint(0, 2**62, ()))
        if request.params.grammar is not None and request.matcher is None:
            request.matcher = self.grammar.matcher(request.params.grammar)
        request.arrival = time.monotonic()
        self._arrivals += 1
        request.seq = self._arrivals
        self.waiting.append(request)

    def cancel(self, request_id: str) -> Request | None:
        """Stop a request now (finish_reason "cancelled"); its blocks are free once no
        micro-batch holding it is in flight."""
        for queue in (self.waiting, self.running):
            for r in queue:
                if r.id == request_id:
                    self._finish(r, "cancelled")
                    return r
        return None

    def load_lora(self, name: str, path: str):
        """Load the PEFT adapter folder `path` as `name` (`LoRAManager.load`; raises
        `inference.lora.LoRAError`, also without --enable-lora)."""
        from .lora import LoRAError

        if self.lora is None:
            raise LoRAError("this server runs without --enable-lora; restart it with "
                            "--enable-lora to serve adapters")
        return self.lora.load(name, path)

    def unload_lora(self, name: str) -> None:
        """Unload adapter `name`; refused (`LoRAError`, 409) while a queued or running
        request uses it."""
        from .lora import LoRAError

        if self.lora is None:
            raise LoRAError("this server runs without --enable-lora", status=404)
        users = [r.id for r in self.waiting + self.running if r.lora_name == name]
        if users:
            raise LoRAError(f"the LoRA adapter {name!r} is in use by {len(users)} request(s); "
                            f"unload it once they have finished", status=409)
        self.lora.unload(name)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.in_flight)

    def stats(self) -> dict:
        """Requests running and waiting, the fraction of KV cache blocks held (0-1), prompt
        tokens looked up in / found in the prefix cache and preemptions so far."""
        return {"running": len(self.running), "waiting": len(self.waiting),
                "kv_cache_usage": self.blocks.usage(),
                "prefix_cache_queries": self.prefix_queries,
                "prefix_cache_hits": self.prefix_hits, "num_preemptions": self.num_preemptions,
                **({"spec_decode": self.spec.stats.as_dict()} if self.spec else {})}

    def load(self) -> int:
        """Tokens still to generate, at most (the router's measure of work)."""
        return sum(r.params.max_new_tokens - len(r.output) for r in self.waiting + self.running)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[Event]:
        """One pipeline tick (with pp = 1: one forward of the replica).

        The first stage starts a micro-batch: a prefill (chunks of running and newly
        admitted requests), else a decode of running requests not already in flight (the
        two alternate while both are pending, but for a burst: `_may_prefill`). Every stage
        runs the micro-batch that reached it (stage s: the one started s ticks ago), then
        passes its output on; the last stage samples, and the micro-batch started pp - 1
        ticks ago returns its ids to every rank.
        With `num_micro_batches` >= pp the stages never wait for each other between tokens.
        Returns the events of the returned micro-batch (none while the pipeline fills)."""
        runner, t = self.runner, self.tick
        flight = self._launch(t)
        if flight is not None:
            self.in_flight[t] = flight
            if runner.last and flight.drafts is None:
                self._start_masks(t, flight)
            self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        mine = self.in_flight.get(t - runner.stage)
        out = None
        if mine is not None:
            hidden, self._received = self._received, None
            extra = {"sources": mine.sources} if self.encoder_decoder else {}
            if self.lora is not None:
                self.lora.bind([r.lora_slot for r in mine.batch], runner.device)
            out = runner.forward(mine.ids, mine.tables, mine.starts,
                                 None if mine.scores_prompt else mine.last, hidden, **extra)
            if self.spec is not None and runner.last:  # MTP drafts keep its hidden states
                self.spec.observe(mine)
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
        if done.drafts is not None:  # speculative: 1 to k + 1 ids per row
            return self._verified(done, out if mine is done and runner.last else None)
        logits = out if mine is done and runner.last else None
        if done.scores_prompt:
            logits = self._score_prompt(done, logits)
        tokens, logprobs = self._sample(done, logits)
        tokens = iter(tokens.tolist())
        events = []
        for r, sampled in zip(done.batch, done.sampled):
            token = next(tokens) if sampled else None
            self.busy.discard(r.id)
            if r.finish_reason is not None:  # cancelled while in flight: free its blocks now
                self._release(r)
                continue
            if token is None:  # a prompt chunk: computed, nothing sampled
                continue
            event = self._append(r, int(token))
            if r.id in logprobs:
                event.logprobs = [logprobs[r.id]]
            events.append(event)
        return events

    def _sample(self, done: _Flight, logits: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
        """The next ids `[k]` of `done`'s k sampled rows on every rank of the replica,
        sampled from their rows of `logits [b, V]` (given on the last stage's ranks, None
        elsewhere), and for the rows whose request asked for log-probabilities {request id:
        (token, logprob, [(id, logprob)] x N)} (inference/sampling.py `token_logprobs`: the
        raw model output). Only those rows are computed, and only steps with such a row
        broadcast them."""
        rows = [i for i, s in enumerate(done.sampled) if s]
        batch = [done.batch[i] for i in rows]
        asked = [i for i, r in enumerate(batch) if r.params.logprobs is not None]
        k = max((batch[i].params.logprobs for i in asked), default=0)
        if not batch:  # prompt chunks only
            return torch.zeros(0, dtype=torch.int64), {}
        tokens = values = None
        masks = self._masks.pop(done.tick, None)
        if logits is not None:
            if len(rows) < len(done.batch):
                logits = logits[torch.tensor(rows, device=logits.device)]
            allowed = logits
            if masks is not None:  # structured outputs: refused ids to -inf (logprobs: raw)
                from .structured import apply_masks

                allowed = apply_masks(logits.float().clone(), [m for m, s in zip(
                    masks.result(), done.sampled) if s])
            tokens = sample(allowed, [r.params for r in batch], [r.seed for r in batch],
                            [len(r.output) for r in batch])
            if asked:
                idx = torch.tensor(asked, device=logits.device)
                values = token_logprobs(logits[idx], tokens[idx], k)
        tokens = broadcast_tokens(tokens, len(batch))
        if not asked:
            return tokens, {}
        values, ids = broadcast_logprobs(values, len(asked), k).tolist(), tokens.tolist()
        return tokens, {batch[i].id: unpack_logprobs(row, ids[i], batch[i].params.logprobs)
                        for i, row in zip(asked, values)}

    def _score_prompt(self, done: _Flight, logits: torch.Tensor | None) -> torch.Tensor | None:
        """Append to the one request of `done` (a prompt chunk that scores its tokens,
        scheduler.py) the log-probabilities of the prompt tokens its logits `[1, n, V]` (last
        stage, None elsewhere) predict and it lacks, on every rank; returns the logits
        `[1, V]` of the chunk's last position, for sampling."""
        r, k = done.batch[0], done.batch[0].params.prompt_logprobs
        start, n = int(done.starts[0]), int(done.last[0]) + 1
        # prompt token j is predicted at position j - 1; tokens 1..len(prompt_lps) are done
        first, end = max(start, len(r.prompt_lps)) + 1, min(start + n, len(r.prompt) - 1)
        if end >= first:
            values = None
            if logits is not None:
                ids = torch.tensor(r.prompt[first:end + 1], device=logits.device)
                values = prompt_token_logprobs(logits[0, first - 1 - start:end - start], ids, k)
            values = broadcast_prompt_logprobs(values, end + 1 - first, k).tolist()
            r.prompt_lps += [unpack_prompt_logprobs(row, t, k)
                             for row, t in zip(values, r.prompt[first:end + 1])]
        return None if logits is None else logits[:, n - 1]

    def _start_masks(self, tick: int, flight: _Flight) -> None:
        """Compute the grammar masks of `flight`'s sampled rows in the worker thread (the
        matchers do not move until the micro-batch returns: its requests are busy)."""
        rows = [r.matcher if s and r.matcher is not None else None
                for r, s in zip(flight.batch, flight.sampled)]
        if not any(m is not None for m in rows):
            return
        if self._mask_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._masks[tick] = self._mask_pool.submit(
            lambda: [None if m is None else m.mask() for m in rows])

    def generate(self, requests: list[Request]) -> list[Request]:
        """Run `requests` to completion (continuous batching when they outnumber the slots)."""
        for r in requests:
            self.add(r)
        while self.has_work():
            self.step()
        return requests

    def _verified(self, done: _Flight, logits: torch.Tensor | None) -> list[Event]:
        """The events of a returned speculative micro-batch (`logits [b, k + 1, V]` on the
        last stage, None elsewhere): each row's emitted ids (inference/spec_decode.py
        `SpecDecoder.verify`) appended one at a time until the request ends (EOS, a stop
        string or max_tokens cut the run there), as one event per request. The accepted
        drafts' cache entries stay (computed by this forward); the rejected ones' positions
        are written again by the next step before anything reads them."""
        streams = [self._tokens(r) for r in done.batch]
        runs, logprobs = self.spec.verify(done.batch, logits, done.drafts, streams)
        events = []
        for r, run, stream in zip(done.batch, runs, streams):
            self.busy.discard(r.id)
            if r.finish_reason is not None:  # cancelled while in flight: free its blocks now
                self._release(r)
                continue
            r.num_computed = len(stream) + len(run) - 1
            event = self._append(r, run[0])
            for token in run[1:]:
                if r.finish_reason is not None:
                    break
                more = self._append(r, token)
                event.token_ids += more.token_ids
                event.text += more.text
                event.finish_reason, event.completion_tokens, event.preemptions = \
                    more.finish_reason, more.completion_tokens, more.preemptions
            if r.id in logprobs:
                event.logprobs = logprobs[r.id][:len(event.token_ids)]
            events.append(event)
        return events

    def _append(self, r: Request, token: int) -> Event:
        r.output.append(token)
        if r.ttft_s is None:
            r.ttft_s = time.monotonic() - r.arrival
        reason = None
        if r.matcher is not None:
            r.matcher.accept(token)
        if token in self.eos and not r.params.ignore_eos:
            reason = "stop"
        elif r.matcher is not None and r.matcher.done:  # the grammar is complete
            reason = "stop"
        elif len(r.output) >= r.params.max_new_tokens:
            reason = "length"
        if self.decode is not None:  # the prompt is the first tokens' context (not for T5)
            if r.out is None:
                r.out = OutputText(self.decode, () if self.encoder_decoder else r.prompt,
                                   r.params.stop)
            reason = r.out.add(token, reason)
        if reason is not None:
            self._finish(r, reason)
        text = r.out.new_text(reason is not None) if r.out is not None else ""
        first = len(r.output) == 1
        return Event(r.id, [token], text, r.finish_reason, len(r.prompt),
                     len(r.output), queue_s=r.queue_s if first else None,
                     preemptions=r.preemptions if reason is not None else None,
                     prompt_logprobs=[None] + r.prompt_lps if first and
                     r.params.prompt_logprobs is not None else None)

    def _finish(self, r: Request, reason: str) -> None:
        r.finish_reason = reason
        if r in self.waiting:
            self.waiting.remove(r)
        if r in self.running:
            self.running.remove(r)
            self.num_left += 1
            if r.id not in self.busy:  # else freed when its micro-batch returns
                self._release(r)

    def _release(self, r: Request) -> None:
        if self.spec is not None:
            self.spec.release(r.id)
        if r.blocks:
            self.blocks.free(r.blocks)
        r.num_computed = r.num_registered = 0
