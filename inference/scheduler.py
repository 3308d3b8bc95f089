"""The engine's scheduler (inference/engine.py's module docstring says what it decides):
which rows the next micro-batch holds -- prompt chunks of running and newly admitted
requests, or one decode token of each running request -- the blocks they take, preemption,
and the micro-batch's tensors. A mixin of `Engine`: it reads and changes the engine's
queues (`waiting`, `running`, `busy`) and its `blocks` (inference/block_manager.py).
`Request` in the annotations is inference.engine.Request (not imported: engine.py imports
this module).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .block_manager import block_tables, token_block_hashes


@dataclass
class _Flight:
    """One micro-batch forward on its way through the pipeline (launched at tick `tick`);
    `sampled[i]`: row i's forward reaches its request's last known token, so it yields the
    next id (a prompt chunk that does not is computed, not sampled)."""

    batch: list
    ids: torch.Tensor
    tables: torch.Tensor
    starts: torch.Tensor
    last: torch.Tensor
    tick: int
    sampled: list
    sources: tuple | None = None  # encoder-decoder prefill: (prompts [b, se], lengths [b])
    drafts: list | None = None  # speculative: the drafted ids [b][k] the forward verifies
    # one row whose request asked for prompt_logprobs and lacks some: the logits of every
    # position of its chunk come back (Engine._score_prompt)
    scores_prompt: bool = False


class Scheduler:
    """`Engine`'s scheduling methods (see the module docstring)."""

    def _tokens(self, r: Request) -> list[int]:
        """The request's known token stream: prompt + output (T5's decoder: the start id 0
        + output; its prompt goes to the encoder)."""
        return ([0] if self.encoder_decoder else r.prompt) + r.output

    def _length(self, r: Request) -> int:
        return (1 if self.encoder_decoder else len(r.prompt)) + len(r.output)

    def _scores_prompt(self, r: Request) -> bool:
        """Whether `r` asked for prompt_logprobs and lacks some: its prompt chunks then run
        alone in their micro-batch, at most `_score_chunk` tokens each, with the logits of
        every position (a [chunk, vocab] float32 block: 64 MiB at most), and it takes no
        prefix-cache hit (a cached position has no logits; vLLM does the same)."""
        return r.params.prompt_logprobs is not None and not self.encoder_decoder and \
            len(r.prompt_lps) < len(r.prompt) - 1

    def _score_chunk(self) -> int:
        return max(16, (1 << 24) // self.runner.config.vocab_size)

    def _launch(self, tick: int) -> _Flight | None:
        """The micro-batch the first stage starts at `tick` (the same on every rank): rows
        `(request, first position, tokens)`."""
        if len(self.in_flight) >= self.num_micro_batches:
            return None
        ready = [r for r in self.running if r.id not in self.busy]
        decodable = sum(r.num_computed == self._length(r) - 1 for r in ready)
        rows = []
        if self._may_prefill(decodable):
            rows = self._prefill_rows(ready)
        self._prefills_in_a_row = self._prefills_in_a_row + 1 if rows else 0
        if not rows:
            rows = self._decode_rows()
            if not rows:
                return None
        return self._flight(rows, tick, prefill=self._prefills_in_a_row > 0)

    def _may_prefill(self, decodable: int) -> bool:
        """Whether the next micro-batch may be a prefill while `decodable` running requests
        wait for a decode step. Prefills and decodes alternate, except that one prefill may
        follow another when it admits more waiting requests than the decode would advance
        (a burst of arrivals: the few requests admitted by the first prefill would take a
        decode step before all the others get their first token; vLLM puts those few
        decodes into the burst's prefill forward, so their next token waits for that
        prefill there too). A decode never waits three prefills."""
        if not decodable or self._prefills_in_a_row == 0:
            return True
        if self._prefills_in_a_row >= 2:
            return False
        admittable = min(len(self.waiting), self.micro_batch_size,
                         self.max_batch_size - len(self.running))
        return admittable > decodable

    def _prefill_rows(self, ready: list[Request]) -> list[tuple]:
        """Prompt chunks for one forward: running requests not yet prefilled first, then
        waiting ones first come first served (their cached prefix taken), while the padded
        tokens stay within `max_num_batched_tokens` (the first row's chunk is cut to it),
        the micro-batch and the running batch have room, and blocks are free. A waiting
        request whose next block a row above computes waits for the next prefill, where it
        shares that block instead of computing it again."""
        budget, rows, longest = self.max_num_batched_tokens, [], 0

        def fits(work: int) -> bool:
            return not rows or (len(rows) + 1) * max(longest, min(work, budget)) <= budget

        for r in [q for q in ready if q.num_computed < self._length(q) - 1]:
            if r not in self.running:  # preempted for a row above
                continue
            n = self._length(r) - r.num_computed
            scores = self._scores_prompt(r)
            if len(rows) >= self.micro_batch_size or not fits(n) or (scores and rows):
                break
            chunk = min(n, budget, self._score_chunk() if scores else n)
            gone = self._make_room(r, r.num_computed + chunk)
            rows = [row for row in rows if row[0] not in gone]
            if r not in gone:
                rows.append((r, r.num_computed, chunk))
                longest = max(longest, chunk)
                if scores:  # alone in its micro-batch
                    return rows
        computing = set()  # names of the full blocks this forward computes
        while self.waiting and len(rows) < self.micro_batch_size and \
                len(self.running) < self.max_batch_size:
            r = self.waiting[0]
            if r.preemptions and self.num_left == r.left_before and \
                    any(q.seq < r.seq for q in self.running):
                break  # preempted: back once a running request has left (_preempt)
            tokens, bs = self._tokens(r), self.blocks.block_size
            cached, scores = [], self._scores_prompt(r)
            if scores and rows:
                break
            if self.blocks.enable_prefix_caching and scores:  # no hit, but name its blocks
                token_block_hashes(tokens, bs, r.hashes, r.cache_salt)
            elif self.blocks.enable_prefix_caching:  # at least the last token is computed
                usable = (len(tokens) - 1) // bs
                token_block_hashes(tokens, bs, r.hashes, r.cache_salt)
                cached = self.blocks.match(r.hashes, usable)
                if len(cached) < usable and r.hashes[len(cached)] in computing:
                    break  # a row above computes its next block: share it next step
            start = len(cached) * bs
            chunk = min(len(tokens) - start, budget, self._score_chunk() if scores else budget)
            work = len(r.prompt) if self.encoder_decoder else len(tokens) - start
            if not fits(work) or not self.blocks.allocate(r.blocks, start + chunk, cached):
                break
            self.waiting.pop(0)
            if self.blocks.enable_prefix_caching:
                self.prefix_queries += len(tokens)
                self.prefix_hits += start
            r.num_computed, r.num_registered = start, len(cached)
            if r.queue_s is None:
                r.queue_s = time.monotonic() - r.arrival
            self.running.append(r)
            rows.append((r, start, chunk))
            longest = max(longest, work if self.encoder_decoder else chunk)
            computing.update(r.hashes[len(cached):(start + chunk) // bs])
            if scores:  # alone in its micro-batch
                break
        return rows

    def _decode_rows(self) -> list[tuple]:
        """One token of each running request ready to decode (not in flight, prefilled), the
        ones decoded longest ago first, preempting for blocks as needed."""
        rows = []
        for r in [q for q in self.running if q.id not in self.busy]:
            if len(rows) >= self.micro_batch_size:
                break
            n = self._length(r)
            if r.num_computed != n - 1 or r not in self.running:  # preempted, or prefilling
                continue
            gone = self._make_room(r, n + self._lookahead(r))
            rows = [row for row in rows if row[0] not in gone]
            if r not in gone:
                rows.append((r, n - 1, 1))
        return rows

    def _lookahead(self, r: Request) -> int:
        """Positions a decode row may write past its last token: the drafts it verifies
        (no more than it may still emit, less the step's own token)."""
        if self.spec is None:
            return 0
        return max(0, min(self.spec.k, r.params.max_new_tokens - len(r.output) - 1))

    def _make_room(self, r: Request, num_tokens: int) -> list[Request]:
        """Give `r` blocks for positions 0..num_tokens-1, preempting the running requests
        that arrived last (`seq`; not in flight) until they fit; the preempted ones (`r`
        itself when it is the last) are returned."""
        gone = []
        while not self.blocks.allocate(r.blocks, num_tokens):
            victim = max((q for q in self.running if q.id not in self.busy),
                         key=lambda q: q.seq)
            self._preempt(victim)
            gone.append(victim)
            if victim is r:
                break
        return gone

    def _preempt(self, r: Request) -> None:
        """Recompute preemption: free `r`'s blocks and queue it first among the requests
        that arrived after it, to prefill prompt + output again (prefix caching may still
        hold its blocks). While requests that arrived before it run, it is admitted again
        only after some running request has left (finished or cancelled): the ones that
        pushed it out still hold what they took and grow on, so taking the freed blocks back
        at once would only be preempted again at their next block (27 preemptions of one
        request without prefix caching, each a full recompute: docs/DECISIONS.md). So
        between two preemptions of a request one that arrived before it has left, and a
        request is preempted at most as many times as requests arrived before it (pp = 1:
        the victim is never passed over for one in flight; tests/test_paged_kv.py)."""
        self.running.remove(r)
        self._release(r)
        r.preemptions += 1
        r.left_before = self.num_left
        self.num_preemptions += 1
        at = next((i for i, q in enumerate(self.waiting) if q.seq > r.seq), len(self.waiting))
        self.waiting.insert(at, r)

    def _flight(self, rows: list[tuple], tick: int, prefill: bool) -> _Flight:
        """The tensors of `rows` (right-padded chunks), their requests marked busy and moved
        to the back of the rotation, and the full blocks they complete named in the prefix
        cache. Rows go in block order (the paged cache reads evenly spaced rows as a view)."""
        rows = sorted(rows, key=lambda row: row[0].blocks[0] if row[0].blocks else 0)
        batch = [r for r, _, _ in rows]
        scores = prefill and len(rows) == 1 and self._scores_prompt(batch[0])
        width = max(n for _, _, n in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.int64)
        sources = None
        if self.encoder_decoder and prefill:  # encode the prompts; decode from the start id 0
            lengths = [len(r.prompt) for r in batch]
            src = torch.zeros(len(rows), max(lengths), dtype=torch.int64)
            for i, r in enumerate(batch):
                src[i, :lengths[i]] = torch.tensor(r.prompt)
            sources = (src, torch.tensor(lengths))
        elif prefill:
            for i, (r, start, n) in enumerate(rows):
                ids[i, :n] = torch.tensor(self._tokens(r)[start:start + n])
        else:  # decode: each row's last known token (and its drafts, speculative)
            ids[:, 0] = torch.tensor([(r.output or r.prompt)[-1] for r in batch])
            if self.spec is not None:
                drafts, padded = self.spec.plan(batch, [self._tokens(r) for r in batch],
                                                self.max_seq_length)
                ids = torch.cat([ids, padded], dim=1)
                width = ids.shape[1]
        starts = torch.tensor([start for _, start, _ in rows])
        bs = self.blocks.block_size
        span = -(-(int(starts.max()) + width) // bs)
        tables = block_tables([r.blocks for r in batch], span)
        sampled = []
        for r, start, n in rows:
            r.num_computed = start + n
            sampled.append(r.num_computed == self._length(r))
            full = r.num_computed // bs
            if self.blocks.enable_prefix_caching and full > r.num_registered:
                token_block_hashes(self._tokens(r), bs, r.hashes, r.cache_salt)
                self.blocks.register(r.blocks, r.hashes, r.num_registered, full)
                r.num_registered = full
        self.busy.update(r.id for r in batch)
        # the micro-batch run longest ago goes first next time (fair rotation)
        self.running = [r for r in self.running if r not in batch] + batch
        if width > 1 and not prefill:  # speculative: the logits of every position
            return _Flight(batch, ids, tables, starts, None, tick, sampled, drafts=drafts)
        return _Flight(batch, ids, tables, starts, torch.tensor([n - 1 for _, _, n in rows]),
                       tick, sampled, sources, scores_prompt=scores)
