"""The model's own multi-token-prediction layer as the draft of speculative decoding
(DeepSeek-V3 report, arXiv:2412.19437, sec. 2.2 and 5.4.3; vLLM's method "mtp" /
"deepseek_mtp", an EAGLE-style proposer): the target's verification is
inference/spec_decode.py's, unchanged (greedy: its argmax; sampled: drafter-invariant
verification, whose output is the plain engine's, in place of Leviathan et al. 2023's
rejection rule); drafts are drawn with the request's keys as a draft model's are.

MTP depth 1 (models/mtp.py) maps the main model's last hidden state h_i (after its final
norm) and the embedding of token t_{i+1} to a state whose output head predicts t_{i+2}.
Drafting for a stream t_0..t_{L-1} (t_{L-1} just sampled, not yet run by the target):
- every position whose main hidden state is known gets its entry: the layer runs on
  (h_{j-1}, t_j) for the new j's, writing its keys/values (an MLA latent for DeepSeek) at
  position j of the request's blocks (a prompt chunk's positions right after the chunk's
  forward, `observe`; the decoded ones when drafting); the output at j = L-1 gives draft 1
  (t_L);
- drafts 2..K reuse the same depth recursively, as vLLM does for K > 1: (the layer's own
  output state after its final norm at the previous position, this repository's h^1, and
  the embedding of the previous draft) at positions
  L, L+1, ... Those entries are provisional and written again once the target's hidden
  states there are known.
An entry at position j depends only on t_0..t_j (h_{j-1} is a function of t_0..t_{j-1}),
so the entries stored in a block are valid wherever the block is shared by prefix caching;
the target's hidden states are taken from its forwards (a hook on its decoder's output),
for the positions each forward computed: a prompt chunk's tokens, a verified row's accepted
drafts and its last token. Position 0 has no entry (no h_{-1}), and neither has the first
position a request computes after a prefix-cache hit (h_{p-1} was computed by another
request and not kept): both keys are masked, so such a row's drafts see one key fewer than
in training (draft quality only; the output is the target's).

The layer's pools are one more layer of the paged cache in the sense of vLLM's: as many
blocks as the target's, indexed by the target's block tables, and counted in the bytes per
token the engine sizes its cache for (`kv_bytes_per_token`), so --kv-cache-memory bounds
both. Under tensor parallelism every rank runs the depth (its heads split like the
model's) and the drafts are broadcast from rank 0 (tested at tp 2). Under pipeline
parallelism the layer lives on the last stage, which looks tokens up in its own copy of the
word embedding (`mtp.word_embeddings`, as in training) and holds the main model's last
hidden states; it drafts there, and every other stage only receives the drafts of the same
`broadcast_tokens` calls (the verification forward needs them on the first stage), so the
pools, the hidden states and the MTP passes are the last stage's alone (tested at pp 2).
Drafting runs no pipeline pass, so the engine keeps its usual micro-batches in flight.
"""
from __future__ import annotations

import torch

import parallel_state as ps
from layers.attention import causal_window_mask

from .block_manager import block_tables
from .sampling import draw, filtered_probs


def mtp_refusal(model) -> str | None:
    """None when `model` (a GPTModel stage) can draft with its MTP layer, else a one-line
    reason naming the fix."""
    if getattr(model.config, "is_encoder_decoder", False):
        return ("speculative decoding is for decoder-only models; this model is an "
                "encoder-decoder (T5): drop the speculative flags")
    if not getattr(model.config, "mtp_num_layers", None):  # (the last stage holds it)
        return ("--speculative-method mtp needs a model with a multi-token-prediction layer "
                "(mtp_num_layers >= 1, e.g. a DeepSeek-V3 checkpoint with its MTP weights); "
                "use --speculative-method ngram or draft_model")
    if model.config.window_size is not None:
        return ("--speculative-method mtp is not built for sliding-window models; use "
                "--speculative-method ngram")
    return None


class MTPProposer:
    """Drafts of the target's MTP depth 1 (module docstring); the same interface as
    `DraftModelProposer` (`attach`, `propose`, `rewind`, `release`) plus `observe`, which the
    engine calls after every forward of the target on the last stage. On another pipeline
    stage (`drafts_here` False) it holds nothing and `propose` receives the last stage's
    drafts. Raises `ValueError` (`mtp_refusal`)."""

    def __init__(self, model, max_seq_length: int, mla_latent_cache: bool = True):
        from .runner import kv_cache_geometry

        why = mtp_refusal(model)
        if why is not None:
            raise ValueError(why)
        self.model, self.max_len = model, max_seq_length
        self.cached: dict[str, int] = {}  # request id -> its first position without an entry
        self.hidden: dict[str, torch.Tensor] = {}  # request id -> h of positions cached-1..
        self.hole: dict[str, int] = {}  # request id -> its masked position after position 0
        self._verified: dict[str, tuple[int, torch.Tensor]] = {}
        self.cache, self.cache_bytes, self.kv_bytes_per_token = None, 0, 0
        self.drafts_here = model.post_process  # the last stage: the layer, the hidden states
        if not self.drafts_here:
            return
        self.depth = model.mtp.layers["0"]
        self.layer_number = self.depth.transformer_layer.layer_number
        self.geometry = kv_cache_geometry(model, mla_latent_cache)
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        groups, head_dim, values = self.geometry
        self.kv_bytes_per_token = (2 if values else 1) * groups * head_dim * p.element_size()
        self._last_hidden = None
        model.decoder.register_forward_hook(self._keep)

    def _keep(self, module, args, out) -> None:
        self._last_hidden = out

    def attach(self, num_blocks: int, block_size: int) -> None:
        """Pools of `num_blocks` blocks of `block_size` positions for the MTP layer (on the
        last stage; nothing elsewhere)."""
        from .kv_cache import PagedKVCache

        if not self.drafts_here:
            return
        groups, head_dim, values = self.geometry
        self.block_size = block_size
        self.cache = PagedKVCache([self.layer_number], num_blocks, block_size, groups,
                                  head_dim, self.dtype, self.device, values=values)
        self.cache_bytes = num_blocks * block_size * self.kv_bytes_per_token

    def release(self, request_id: str) -> None:
        for d in (self.cached, self.hidden, self.hole, self._verified):
            d.pop(request_id, None)

    @torch.inference_mode()
    def observe(self, flight) -> None:
        """Keep the target's hidden states `[s, b, h]` of the forward of `flight` just run:
        a prompt chunk's or plain decode's positions starts..starts + last, a verified
        row's k_b + 1 positions (kept by `rewind` once the accepted count is known)."""
        out, self._last_hidden = self._last_hidden, None
        if out is None:
            return
        for i, r in enumerate(flight.batch):
            start = int(flight.starts[i])
            if flight.drafts is not None:
                self._verified[r.id] = (start, out[:, i].detach())
            else:
                self._add(r.id, start, out[:int(flight.last[i]) + 1, i].detach())
        if flight.drafts is None:  # the chunk's entries now, before a prefix hit reads them
            ends = [int(s) + int(n) + 1 for s, n in zip(flight.starts, flight.last)]
            self._write(flight.batch, [(r.prompt + r.output)[:e]
                                       for r, e in zip(flight.batch, ends)])

    def _add(self, rid: str, start: int, h: torch.Tensor) -> None:
        """Append the target's hidden states `h [n, h]` of positions start.. of `rid`."""
        if rid not in self.cached:  # first forward: entries from start + 1; start masked
            self.cached[rid], self.hole[rid] = start + 1, start
            self.hidden[rid] = h
            return
        have = self.cached[rid] - 1 + len(self.hidden[rid])  # positions known so far
        if start != have:  # out of step (recomputed elsewhere): start over from here
            self.release(rid)
            return self._add(rid, start, h)
        self.hidden[rid] = torch.cat([self.hidden[rid], h])

    def rewind(self, request_id: str, stream_length: int, accepted: int, k: int) -> None:
        """After verification: the target's hidden states of the row's last token and its
        `accepted` drafts are those of the new stream."""
        got = self._verified.pop(request_id, None)
        if got is not None:
            self._add(request_id, got[0], got[1][:accepted + 1])

    @torch.inference_mode()
    def propose(self, batch, streams: list[list[int]], k: int, wanted: list[int]
                ) -> list[list[int]]:
        """`k` drafts per row of `batch` (`streams`: prompt + output), identical on every
        rank: row i's first `wanted[i]` are `draw`n with its request's parameters and seed at
        its output positions (the keys verification uses), the rest are the argmax."""
        from .comm import broadcast_tokens

        b = len(batch)
        drafts = torch.zeros(b, k, dtype=torch.int64)
        if not self.drafts_here:  # another pipeline stage: the last stage's drafts
            for j in range(k):
                drafts[:, j] = broadcast_tokens(None, b)
            return drafts.tolist()
        ids, h, starts, last = self._catch_up(batch, streams)
        self._consume(batch, streams)
        for j in range(k):
            logits, state = self._run(batch, ids, h, starts, last)
            picked = logits.argmax(dim=-1)
            for i, r in enumerate(batch):
                if r.params.temperature != 0 and j < wanted[i]:
                    picked[i] = draw(filtered_probs(logits[i], r.params), r.seed,
                                     len(r.output) + j)
            drafts[:, j] = broadcast_tokens(picked.cpu(), b)
            starts = starts + last + 1
            ids, h, last = drafts[:, j:j + 1].clone(), state[:, None], torch.zeros_like(last)
        return drafts.tolist()

    def _write(self, batch, streams: list[list[int]]) -> None:
        """Write the entries of positions cached .. len(stream) - 1 of the rows that have
        any (a prompt chunk's tokens after the first), without drafting."""
        rows = [i for i, (r, s) in enumerate(zip(batch, streams)) if len(s) > self.cached[r.id]]
        if rows:
            batch, streams = [batch[i] for i in rows], [streams[i] for i in rows]
            self._run(batch, *self._catch_up(batch, streams))
            self._consume(batch, streams)

    def _consume(self, batch, streams: list[list[int]]) -> None:
        """Positions up to len(stream) - 1 have their entries: drop the hidden states used."""
        for r, s in zip(batch, streams):
            self.hidden[r.id] = self.hidden[r.id][len(s) - self.cached[r.id]:]
            self.cached[r.id] = len(s)

    def _catch_up(self, batch, streams):
        """The first pass's right-padded inputs: per row the tokens t_j and hidden states
        h_{j-1} of its positions j = cached .. L-1, L = len(stream) (`ids [b, n]`,
        `h [b, n, h]`), the first positions `[b]` and each row's last index `[b]`."""
        rows = []
        for r, s in zip(batch, streams):
            c = self.cached[r.id]
            if c - 1 + len(self.hidden[r.id]) < len(s) - 1:
                raise RuntimeError(f"request {r.id}: the MTP draft holds hidden states to "
                                   f"position {c - 2 + len(self.hidden[r.id])}, its stream "
                                   f"{len(s)} tokens")
            rows.append((s[c:], self.hidden[r.id][:len(s) - c], c))
        n = max(len(t) for t, _, _ in rows)
        ids = torch.zeros(len(batch), n, dtype=torch.int64)
        h = torch.zeros(len(batch), n, rows[0][1].shape[-1], dtype=self.dtype,
                        device=self.device)
        for i, (t, hid, _) in enumerate(rows):
            ids[i, :len(t)] = torch.tensor(t)
            h[i, :len(t)] = hid
        return (ids, h, torch.tensor([c for _, _, c in rows]),
                torch.tensor([len(t) - 1 for t, _, _ in rows]))

    @torch.inference_mode()
    def _run(self, batch, ids, h, starts, last):
        """One pass of the depth over `ids [b, s]` and hidden states `h [b, s, h]` at
        positions starts[i] + 0..s-1 (eq. 21-23): `(logits [b, V] float32, state [b, h])`
        at each row's `last` index."""
        model, dev = self.model, self.device
        b, s = ids.shape
        positions = (starts[:, None] + torch.arange(s)[None, :]).to(dev)
        length = int(starts.max()) + s
        tables = block_tables([r.blocks for r in batch], -(-length // self.block_size))
        allowed = causal_window_mask(positions, length, None)  # [b, s, length]
        holes = torch.tensor([self.hole[r.id] for r in batch], device=dev)
        keys = torch.arange(length, device=dev)
        allowed = allowed & (keys != 0) & (keys[None] != holes[:, None])[:, None]
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=dev).masked_fill_(
            ~allowed, float("-inf"))[:, None]
        self.cache.bind(tables, positions, length)
        rotary = None
        if model.rotary is not None:
            rotary = model.rotary(s, 0, device=dev, position_ids=positions)
            if model.rotary_local is not None:
                rotary = rotary + model.rotary_local(s, 0, device=dev, position_ids=positions)
        d = self.depth
        embed = model.mtp.word_embeddings  # pp > 1: the last stage's copy
        if embed is None:
            embed = model.embedding.word_embeddings
        emb = embed(ids.t().to(dev))  # [s, b, h]
        x = d.eh_proj(torch.cat([d.enorm(emb), d.hnorm(h.transpose(0, 1))], dim=-1))
        x = d.transformer_layer(x, rotary=rotary, kv_cache=self.cache.layer(self.layer_number),
                                attention_mask=mask)
        state = d.final_layernorm(x)[last.to(dev), torch.arange(b, device=dev)]  # [b, h]
        logits = model.output_layer(state[None], weight=model.output_weight())[0]
        cap = model.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        logits = ps.gather_from_tensor_model_parallel_region(logits)
        return logits[:, :model.config.vocab_size].float(), state
