"""The model runner of one pipeline stage of a replica: one forward of a micro-batch of rows
over this rank's model chunk with the KV cache (decoder-only models; inference/seq2seq.py
subclasses it for T5). Split from the engine (inference/engine.py), which schedules the rows,
so the seq2seq runner can build on it without importing the engine."""
from __future__ import annotations

import torch

import parallel_state as ps
from layers import attention_kernels, compile_transformer_block
from layers.attention import LAYER_TYPES, causal_window_mask
from layers.linear import pack_weights
from parallel_state import p2p

from .comm import replica_min
from .kv_cache import KVCache, PagedKVCache
from .loading import available_memory


# compiled variants of TransformerBlock._forward (per layer: TransformerLayer.forward) one
# process may hold (torch._dynamo's recompile_limit, default 8, counts them per code
# object): prefill and decode, one row and several, fresh / strided / gathered cache reads,
# a draft model's shapes; past the limit a new variant runs eagerly
RECOMPILE_LIMIT = 64


def compile_for_inference(model) -> int:
    """`torch.compile` the layers of `model` for the engine (infer.py --compile; vLLM
    compiles by default) as one compiled call per step (`compile_transformer_block`: each
    layer a nested compile region inside it; per layer where a layer cannot trace whole, as
    a mixture-of-experts one): inductor fuses each layer's norms, RoPE, SwiGLU and residual
    adds into generated kernels and the layers' Python runs once per compile instead of
    once per layer and step; the GEMMs stay oneDNN's calls on the packed weights
    (layers/gemm.py), prefill attention torch's SDPA (over at most 128 keys: float32
    matmuls around inductor's fused softmax) and decode attention a C++ kernel
    (layers/attention_kernels.py; inductor's own loops where it cannot be built or does not
    apply: layers/attention.py `core_attention`). Every layer shares one compiled region per
    variant: each layer reads its own cache through a handle (`PagedKVCache.layer`), and a
    size that changes (batch, lengths, block offsets) becomes symbolic at its first change
    (dynamo's automatic dynamic shapes; the hidden sizes stay static, which gave SmolLM2
    ~5-10% more decode tokens/s than `dynamic=True`). The first steps of each variant
    (prefill, decode; one row, several; the first change of a size) pay the compiling:
    ~10-40 s each for SmolLM2 on 2 CPU cores.

    In place and once: an engine built again on the same model reuses the graphs, and runs
    compiled whatever its own `compile` says. Greedy output equals the eager engine's up to
    float rounding (fused kernels sum in another order). Returns the number of layers
    compiled. Raises `ValueError` on a CPU without a C++ compiler (inductor's CPU kernels
    are C++; the message says how to get one) and for an encoder-decoder model (T5's
    contiguous cache is read by layer number)."""
    import torch._dynamo.config as dynamo_config

    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError("--compile is for decoder-only models; T5 runs eagerly: drop "
                         "--compile")
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    try:
        compiled = compile_transformer_block(model)
    except RuntimeError as e:  # no C++ compiler: a usage error here, before any request
        raise ValueError(str(e)) from None
    attention_kernels.prepare()  # decode attention's C++ kernel, built before any tracing
    return compiled


def kv_cache_geometry(model, mla_latent_cache: bool = True) -> tuple[int, int, bool]:
    """`(groups, head_dim, values)` of the paged cache (`PagedKVCache`) of decoder-only
    `model`'s stage on this rank: keys and values of its layers' local KV heads, or, for
    multi-head latent attention with `mla_latent_cache`, one latent of kv_lora_rank +
    qk_rope_head_dim per token and layer, no values (layers/mla.py)."""
    attn = next(iter(model.decoder.layers.values())).self_attention
    latent_dim = getattr(attn, "latent_dim", None)
    if mla_latent_cache and latent_dim:
        return 1, latent_dim, False
    return attn.num_groups, attn.head_dim, True


def kv_bytes_per_token(model, mla_latent_cache: bool = True) -> int:
    """Bytes one token position takes in the paged cache of decoder-only `model`'s stage on
    this rank (`kv_cache_geometry`, in its parameters' dtype)."""
    groups, head_dim, values = kv_cache_geometry(model, mla_latent_cache)
    return PagedKVCache.bytes_per_token(len(model.layer_numbers), groups, head_dim,
                                        next(model.parameters()).dtype, values)


class ModelRunner:
    """Runs this rank's model chunk for one micro-batch of rows.

    `forward(ids [b, s], tables [b, n], starts [b], last [b], hidden)` -> this stage's output:
    hidden states `[s, b, h]` for the next stage, or on the last stage the logits `[b, vocab]`
    of token `last[i]` of each row, gathered over the vocab-parallel head and cut to the real
    vocabulary (padding ids can never be produced; only these rows' last tokens go through
    the output layer; `last` None: the logits `[b, s, vocab]` of every position, for
    speculative verification). Row i's tokens go to positions `starts[i] + 0..s-1`; `hidden`
    is the previous stage's output tuple (None on the first stage, which embeds `ids`); `tables` are
    the rows' block tables in the paged cache (`PagedKVCache`, n >= ceil((max(starts) + s) /
    block_size), padded with the null block 0).

    The cache holds `num_blocks` blocks of `block_size` positions (block 0 reserved):
    `kv_cache_memory` bytes (int) or that fraction of the memory this rank may allocate
    (float, `loading.available_memory`) over the bytes of a block on this stage plus
    `shared_bytes_per_token` x `block_size` (the pools of other caches indexed by the same
    block tables: a speculative draft model's, inference/spec_decode.py), the smallest over
    the replica's ranks (stages hold different layers; all must agree); default
    `max_batch_size` requests of `max_seq_length` tokens, the old slot cache's size.
    `num_blocks` given: exactly that many (a draft model's pools, sized by its target's).

    `compile` (--compile): `compile_for_inference(model)`, before anything else.
    `mla_latent_cache`: a multi-head latent attention model caches its latents, not full
    K/V (`kv_cache_geometry`).
    """

    def __init__(self, model, max_batch_size: int, max_seq_length: int, block_size: int = 16,
                 kv_cache_memory: int | float | None = None, compile: bool = False,
                 shared_bytes_per_token: int = 0, num_blocks: int | None = None,
                 mla_latent_cache: bool = True):
        if compile:  # wraps the layers (compiling waits for the first step): refusals first
            compile_for_inference(model)
        self.model = model.eval()
        self.config = model.config
        # oneDNN's pre-packed weights on CPU in float32 (layers/gemm.py): decode's few-row
        # products read them 1.5-2.3x faster; they take as much memory again as the weights
        self.packed_bytes = pack_weights(
            model, extra=(model.output_weight(),) if model.post_process else ())
        attn = self._first_attention()
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.block_size, self.kv_cache_memory = block_size, kv_cache_memory
        self.shared_bytes_per_token, self.num_blocks = shared_bytes_per_token, num_blocks
        self.mla_latent_cache = mla_latent_cache
        self.cache = self._make_cache(attn, max_batch_size, max_seq_length)
        self.first, self.last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        self.stage = ps.get_pipeline_model_parallel_rank()
        self.pp = ps.get_pipeline_model_parallel_world_size()

    def _first_attention(self):
        return next(iter(self.model.decoder.layers.values())).self_attention

    def _make_cache(self, attn, slots: int, max_len: int) -> PagedKVCache:
        bs = self.block_size
        if bs < 1:
            raise ValueError(f"--kv-block-size must be >= 1, got {bs}")
        self.bytes_per_token = kv_bytes_per_token(self.model, self.mla_latent_cache)
        memory = self.kv_cache_memory
        if self.num_blocks is not None:
            blocks = self.num_blocks
        elif memory is None:
            blocks = slots * -(-max_len // bs) + 1
        else:
            if isinstance(memory, float):
                have, _ = available_memory(self.device)
                memory = int(memory * have)
            per_block = (self.bytes_per_token + self.shared_bytes_per_token) * bs
            blocks = replica_min(memory // per_block)
        self.cache_bytes = blocks * bs * self.bytes_per_token
        groups, head_dim, values = kv_cache_geometry(self.model, self.mla_latent_cache)
        return PagedKVCache(self.model.layer_numbers, blocks, bs, groups, head_dim, self.dtype,
                            self.device, values=values)

    def spec(self, ids: torch.Tensor) -> p2p.TensorSpec:
        """What a stage passes on for a micro-batch of `ids [b, s]`: `[s, b, h]`."""
        b, s = ids.shape
        return p2p.TensorSpec(((s, b, self.config.hidden_size),), self.dtype, self.device)

    def incoming(self, flight) -> p2p.TensorSpec | None:
        """What this stage receives from the previous one for `flight` (None: nothing)."""
        return None if self.first else self.spec(flight.ids)

    def outgoing(self, out, flight) -> tuple | None:
        """What this stage sends on for `flight` after running it (None: nothing)."""
        return None if self.last else (out,)

    def _mask(self, positions: torch.Tensor, length: int, window) -> torch.Tensor:
        """`[b, 1, s, length]` additive mask of rows whose tokens sit at `positions [b, s]`:
        key position <= query position, and inside the sliding `window` when given."""
        allowed = causal_window_mask(positions, length, window)
        # additive, made once here: a bool mask is turned into this by SDPA in every layer
        return torch.zeros(allowed.shape, dtype=self.dtype, device=positions.device) \
            .masked_fill_(~allowed, float("-inf"))[:, None]

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, tables: torch.Tensor, starts: torch.Tensor,
                last: torch.Tensor, hidden: tuple | None) -> torch.Tensor:
        hidden = hidden[0] if hidden is not None else None
        b, s = ids.shape
        dev = self.device
        if s == 1:  # decode: one token per row at its own position
            positions = starts[:, None].to(dev)
        else:
            positions = (starts[:, None] + torch.arange(s)[None, :]).to(dev)  # [b, s]
        length = int(starts.max()) + s
        mask = self._mask(positions, length, None)
        if self.config.window_size is not None:  # one mask per kind of layer (SelfAttention)
            mask = {LAYER_TYPES[0]: mask,
                    LAYER_TYPES[1]: self._mask(positions, length, self.config.window_size)}
        self.cache.bind(tables, positions, length, fresh=length == s)
        out = self.model(ids.to(dev) if self.first else None, position_ids=positions,
                         hidden_states=hidden, kv_cache=self.cache, attention_mask=mask,
                         output_positions=last.to(dev) if self.last and last is not None
                         else None)
        if not self.last:
            return out
        if last is None:  # every position (speculative verification): [b, s, vocab]
            return ps.gather_from_tensor_model_parallel_region(out)[..., :self.config.vocab_size]
        local = out[:, 0]  # [b, v_padded / tp]
        return ps.gather_from_tensor_model_parallel_region(local)[:, :self.config.vocab_size]
