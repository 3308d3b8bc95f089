"""Encoder-decoder (T5) generation: the encoder runs once per request, when it is admitted;
the decoder then decodes one token per step with two caches per layer: its self-attention
keys/values (appended each step, as for GPT) and the cross-attention keys/values of the
encoder output (computed once at admission and kept in the request's slot).

The decoder starts from id 0 (T5's decoder start, the pad id) at position 0; generated token
k is the decoder input at position k + 1. A request's prompt is the encoder input.
"""
from __future__ import annotations

import torch

import parallel_state as ps
from parallel_state import p2p

from .runner import ModelRunner
from .kv_cache import KVCache


class CrossKVCache(KVCache):
    """`KVCache` of the decoder's self-attention plus, per layer, `[slots, max_source, n, d]`
    cross-attention keys/values of each slot's encoder output and the slot's source length.

    `bind_cross(slots, lengths | None)`: with `lengths [b]` the batch was just encoded
    (prefill): `cross(layer, compute)` stores `compute()`'s `[b, n, se, d]` keys/values in the
    slots; with None it reads them back. `cross_mask()` -> `[b, se]` bool, True on each
    row's real source tokens.
    """

    def __init__(self, layer_numbers, slots: int, max_len: int, max_source: int, heads: int,
                 head_dim: int, dtype, device):
        super().__init__(layer_numbers, slots, max_len, heads, head_dim, dtype, device)
        shape = (slots, max_source, heads, head_dim)
        self.max_source = max_source
        self.ck = {n: torch.zeros(shape, dtype=dtype, device=device) for n in layer_numbers}
        self.cv = {n: torch.zeros(shape, dtype=dtype, device=device) for n in layer_numbers}
        self.source_len = torch.zeros(slots, dtype=torch.int64)
        self._fresh = False

    def bind_cross(self, slots: torch.Tensor, lengths: torch.Tensor | None) -> None:
        self._cross_slots, self._fresh = slots, lengths is not None
        if lengths is not None:
            if int(lengths.max()) > self.max_source:
                raise ValueError(f"a prompt of {int(lengths.max())} tokens is longer than the "
                                 f"encoder's {self.max_source} (--max-source-length)")
            self.source_len[slots] = lengths
        self._source = int(self.source_len[slots].max())

    def cross_mask(self) -> torch.Tensor:
        lengths = self.source_len[self._cross_slots].to(self.k_device)
        return torch.arange(self._source, device=self.k_device)[None, :] < lengths[:, None]

    @property
    def k_device(self):
        return next(iter(self.ck.values())).device

    def cross(self, layer_number: int, compute):
        slots = self._cross_slots.to(self.k_device)
        kc, vc = self.ck[layer_number], self.cv[layer_number]
        if self._fresh:
            k, v = compute()  # [b, n, se, d]
            kc[slots, :k.shape[2]] = k.transpose(1, 2).to(kc.dtype)
            vc[slots, :v.shape[2]] = v.transpose(1, 2).to(vc.dtype)
            return k, v
        return kc[slots, :self._source].transpose(1, 2), vc[slots, :self._source].transpose(1, 2)


class Seq2SeqRunner(ModelRunner):
    """The `ModelRunner` of a T5Model stage: encoder stages (before the split) run only on
    prefill micro-batches; decoder stages on every micro-batch.

    `forward(ids [b, 1], tables [b, 1], starts, last, hidden, sources=None)`: the request
    in slot `tables[i, 0]` (the engine hands T5 one "block" of max_seq_length positions per
    request: its slot of the contiguous cache). With `sources`
    `(prompt ids [b, se] right-padded, lengths [b])` the rows are new (prefill): the encoder
    runs (on its stages) and each decoder stage stores the cross-attention keys/values of the
    encoder output in the slots; then one decoder step of `ids` at positions `starts`.
    Between stages travel the encoder hidden `[se, b, h]` (prefill, encoder stages), `(decoder
    hidden [1, b, h], encoder output [se, b, h])` (prefill, decoder stages) or the decoder
    hidden alone (decode). The last stage returns the logits `[b, vocab]` of each row's
    token, gathered over the vocab-parallel head.
    """

    def __init__(self, model, max_batch_size: int, max_seq_length: int, max_source_length: int,
                 compile: bool = False):
        self.max_source_length = max_source_length
        self.encoder_stage = model.add_encoder and not model.add_decoder  # pp > 1
        # compile: refused by `compile_for_inference` (T5's cache is read by layer number)
        super().__init__(model, max_batch_size, max_seq_length, compile=compile)

    def _make_cache(self, attn, slots: int, max_len: int) -> CrossKVCache:
        return CrossKVCache(self.model.decoder_layer_numbers, slots, max_len,
                            self.max_source_length, attn.num_groups, attn.head_dim, self.dtype,
                            self.device)

    def _first_attention(self):
        block = self.model.decoder if self.model.add_decoder else self.model.encoder
        return next(iter(block.layers.values())).self_attention

    def incoming(self, flight) -> p2p.TensorSpec | None:
        if self.first:
            return None
        b, h = flight.ids.shape[0], self.config.hidden_size
        if flight.sources is None:  # decode: decoder stages after the first get the hidden
            if self.encoder_stage or self.model.decoder_pre_process:
                return None
            return p2p.TensorSpec(((1, b, h),), self.dtype, self.device)
        enc = (flight.sources[0].shape[1], b, h)
        shapes = (enc,) if self.encoder_stage or self.model.decoder_pre_process else \
            ((1, b, h), enc)
        return p2p.TensorSpec(shapes, self.dtype, self.device)

    def outgoing(self, out, flight) -> tuple | None:
        if self.last or out is None:
            return None
        return out if isinstance(out, tuple) else (out,)

    @torch.inference_mode()
    def forward(self, ids, tables, starts, last, hidden, sources=None):
        model, dev, slots = self.model, self.device, tables[:, 0]
        if sources is not None:
            source, lengths = sources
            source_mask = (torch.arange(source.shape[1])[None, :] < lengths[:, None]).to(dev)
        if self.encoder_stage:
            if sources is None:
                return None  # decoding does not involve the encoder
            return model.encode(source.to(dev) if model.encoder_pre_process else None,
                                hidden[0] if hidden else None, encoder_attention_mask=source_mask)
        b, s = ids.shape
        positions = (starts[:, None] + torch.arange(s)[None, :]).to(dev)  # [b, s]
        length = int(starts.max()) + s
        mask = torch.arange(length, device=dev)[None, None, :] <= positions[:, :, None]
        self.cache.bind(slots, positions, length)
        first = model.decoder_pre_process
        encoder_output, dec_hidden = None, None
        if sources is not None and model.add_encoder:  # the whole model on this stage
            encoder_output = model.encode(source.to(dev), encoder_attention_mask=source_mask)
        elif sources is not None:
            encoder_output = hidden[0] if first else hidden[1]
        if not first:
            dec_hidden = hidden[0]
        self.cache.bind_cross(slots, lengths if sources is not None else None)
        out = model.decode(ids.to(dev) if first else None, encoder_output,
                           hidden_states=dec_hidden, kv_cache=self.cache,
                           position_ids=positions, attention_mask=mask[:, None],
                           encoder_attention_mask=self.cache.cross_mask(),
                           output_positions=last.to(dev) if self.last else None)
        if not self.last:
            return (out, encoder_output) if sources is not None else (out,)
        return ps.gather_from_tensor_model_parallel_region(out[:, 0])[:, :self.config.vocab_size]


class SourceTokenizer:
    """A tokenizer as a T5 prompt needs it: `encode` appends EOS to the encoder input (as
    T5's tokenizer does and as the span-corruption inputs end), `decode` writes the sentinel
    ids above the tokenizer's vocabulary as `<extra_id_k>` (sentinel k = vocab - 1 - k).
    Everything else is the wrapped tokenizer's."""

    def __init__(self, tokenizer, model_vocab_size: int):
        self._tok, self.model_vocab_size = tokenizer, model_vocab_size

    def __getattr__(self, name):
        if name == "_tok" or name.startswith("__"):  # unpickling (the API server process)
            raise AttributeError(name)
        return getattr(self._tok, name)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text) + [self._tok.eod]

    def decode(self, ids) -> str:
        out, run = [], []
        for t in (int(i) for i in ids):
            if t >= self._tok.vocab_size:
                out.append(self._tok.decode(run))
                run = []
                out.append(f"<extra_id_{self.model_vocab_size - 1 - t}>")
            else:
                run.append(t)
        return "".join(out) + self._tok.decode(run)

    def token_bytes(self, token_id: int) -> bytes | None:
        """`Tokenizer.token_bytes`, with a sentinel id's `<extra_id_k>`."""
        t = int(token_id)
        if self._tok.vocab_size <= t < self.model_vocab_size:
            return f"<extra_id_{self.model_vocab_size - 1 - t}>".encode()
        return self._tok.token_bytes(t)
