"""Pre-norm transformer layer and block, built from the parallel pieces.

Layer: `x = x + dropout(attn(norm1(x)))`, `x = x + dropout(mlp(norm2(x)))` (GPT-2 / Llama
pre-normalization, Radford et al. 2019 sec. 2.3); with `post_self_attn_layernorm` /
`post_mlp_layernorm` the sublayer's output is normalized before the add (Gemma 2/3's
"sandwich": `x + dropout(norm(attn(norm1(x))))`). Activations are `[s, b, h]`, or sequence
shards `[s/tp, b, h]` under sequence parallelism, where norms and dropout run on the shard.

An encoder-decoder model builds its encoder from bidirectional layers (`causal=False`) and its
decoder from layers with `cross_attention`: `x = x + dropout(cross_attn(norm(x), encoder
output))` between self-attention and the MLP (Vaswani et al. 2017, sec. 3.1; T5's order).

A block holds the layers of one pipeline chunk in a ModuleDict keyed by *global* layer number
(0-based), so parameter names (`layers.7.mlp.linear_fc1.weight`) are the same at any pipeline
layout; they seed initialization and key checkpoints.
"""
from __future__ import annotations

import itertools
import os
import types
import warnings

import torch
import torch.distributed as dist
from torch import nn

from parallel_state import get_tensor_model_parallel_world_size

from .attention import CrossAttention, SelfAttention
from .context_parallel import local_positions
from .dropout import (
    SITE_ATTENTION_RESIDUAL,
    add_dropout_site,
    SITE_CROSS_ATTENTION_RESIDUAL,
    SITE_MLP_RESIDUAL,
    hidden_dropout,
    sub_site,
)
from .mla import MultiLatentAttention
from .mlp import MLP
from .moe import MoELayer
from .norm import build_norm


class TransformerLayer(nn.Module):
    """One pre-norm layer; its MLP is a MoELayer where `config.is_moe_layer(layer_number)`,
    its self-attention multi-head latent attention (layers/mla.py) where
    `config.multi_latent_attention`.
    `causal=False`: bidirectional self-attention (an encoder);
    `cross_attention`: a decoder layer of an encoder-decoder model; `softmax_scale`: see
    SelfAttention (T5: 1.0). `cp_group` / `cp_comm_type`: context parallelism (see
    SelfAttention): `x` is this CP rank's part of each sequence, and the residual dropouts
    are keyed by its tokens' global positions."""

    def __init__(self, config, layer_number: int, sequence_parallel: bool = False,
                 causal: bool = True, cross_attention: bool = False,
                 softmax_scale: float | None = None, cp_group=None,
                 cp_comm_type: str = "p2p"):
        super().__init__()
        sp = sequence_parallel and get_tensor_model_parallel_world_size() > 1
        self.cp_group = cp_group
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout
        add_dropout_site(self)  # set from the module's name (layers/dropout.py)
        self.sequence_parallel = sp
        # no pre-norms (`pre_layernorm` False, OLMo 2): identities, the forward unchanged
        self.input_layernorm = build_norm(config, sequence_parallel=sp) \
            if config.pre_layernorm else nn.Identity()
        if getattr(config, "multi_latent_attention", False) and causal and not cross_attention:
            self.self_attention = MultiLatentAttention(config, layer_number, sequence_parallel=sp,
                                                       cp_group=cp_group,
                                                       cp_comm_type=cp_comm_type)
        else:
            self.self_attention = SelfAttention(config, layer_number, sequence_parallel=sp,
                                                causal=causal, softmax_scale=softmax_scale,
                                                cp_group=cp_group, cp_comm_type=cp_comm_type)
        if cross_attention:
            self.pre_cross_attn_layernorm = build_norm(config, sequence_parallel=sp)
            self.cross_attention = CrossAttention(config, layer_number, sequence_parallel=sp,
                                                  softmax_scale=softmax_scale)
        else:
            self.cross_attention = None
        self.pre_mlp_layernorm = build_norm(config, sequence_parallel=sp) \
            if config.pre_layernorm else nn.Identity()
        self.mlp = MoELayer(config, layer_number, sequence_parallel=sp) \
            if config.is_moe_layer(layer_number) else MLP(config, sequence_parallel=sp)
        # Gemma's sandwich norms: on the attention / MLP output, before the residual add
        self.post_self_attn_layernorm = build_norm(config, sequence_parallel=sp) \
            if config.post_self_attn_layernorm else None
        self.post_mlp_layernorm = build_norm(config, sequence_parallel=sp) \
            if config.post_mlp_layernorm else None

    def _residual(self, x, y, site: int):
        if self.hidden_dropout == 0 or not self.training:  # no site arithmetic per call
            return x + y
        positions = None
        if self.cp_group is not None:
            rows = y.shape[0] * (get_tensor_model_parallel_world_size()
                                 if self.sequence_parallel else 1)
            positions = context_parallel_positions(rows, self.cp_group)
        return x + hidden_dropout(y, self.hidden_dropout, self.training,
                                  sub_site(self.dropout_site, site), self.sequence_parallel,
                                  positions=positions)

    def forward(self, x: torch.Tensor, rotary=None, kv_cache=None, attention_mask=None,
                attention_bias=None, encoder_output=None,
                cross_attention_mask=None) -> torch.Tensor:
        """`x [s, b, h]` (or `[s/tp, b, h]`) -> same shape (masks and bias: see SelfAttention
        and CrossAttention; `encoder_output [se, b, h]` (SP: `[se/tp, b, h]`) for a decoder
        layer with cross-attention)."""
        y = self.self_attention(self.input_layernorm(x), rotary=rotary, kv_cache=kv_cache,
                                attention_mask=attention_mask, attention_bias=attention_bias)
        if self.post_self_attn_layernorm is not None:
            y = self.post_self_attn_layernorm(y)
        x = self._residual(x, y, SITE_ATTENTION_RESIDUAL)
        if self.cross_attention is not None:
            if encoder_output is None and kv_cache is None:
                raise ValueError("a decoder layer with cross-attention needs encoder_output")
            x = self._residual(x, self.cross_attention(
                self.pre_cross_attn_layernorm(x), encoder_output,
                attention_mask=cross_attention_mask, kv_cache=kv_cache),
                SITE_CROSS_ATTENTION_RESIDUAL)
        y = self.mlp(self.pre_mlp_layernorm(x))
        if self.post_mlp_layernorm is not None:
            y = self.post_mlp_layernorm(y)
        return self._residual(x, y, SITE_MLP_RESIDUAL)


def context_parallel_positions(rows: int, cp_group) -> torch.Tensor:
    """Global positions `[rows]` of a CP rank's `rows` tokens of each sequence (its
    load-balanced part of a sequence `rows * cp` long: layers/context_parallel)."""
    cp = dist.get_world_size(cp_group)
    return local_positions(rows * cp, cp, dist.get_rank(cp_group))


class TransformerBlock(nn.Module):
    """The layers `layer_numbers` (global, 0-based) of the model, plus the final norm when
    `post_layer_norm` (the last pipeline stage). `layer_kwargs` go to every TransformerLayer
    (`causal`, `cross_attention`, `softmax_scale`, `cp_group`, `cp_comm_type`). `kv_cache`
    (inference), when given, has `layer(layer_number)`: the handle each layer's attention
    reads and writes its own cache through (a separate object per layer, so a compiled layer
    sees only tensors and one graph serves every layer)."""

    def __init__(self, config, layer_numbers: list[int], post_layer_norm: bool = True,
                 sequence_parallel: bool = False, **layer_kwargs):
        super().__init__()
        sp = sequence_parallel and get_tensor_model_parallel_world_size() > 1
        self.layers = nn.ModuleDict({
            str(n): TransformerLayer(config, n, sequence_parallel=sp, **layer_kwargs)
            for n in layer_numbers})
        self.final_layernorm = build_norm(config, sequence_parallel=sp) if post_layer_norm else None
        # Set by the recompute policy (layers/recompute.py): `checkpoint_fn(fn, *tensors)`
        # runs fn keeping only its inputs for backward; `recompute_spans` are the (start,
        # stop) positions of the layer groups each checkpointed as one unit (training only).
        self.checkpoint_fn = None
        self.recompute_spans: list[tuple[int, int]] = []
        # Set by compile_transformer_block (inference): `_forward` compiled whole, each layer
        # one nested compile region inside it, and the `dynamic` it was compiled with
        self.compiled_forward = None
        self.compile_dynamic: bool | None = None

    def forward(self, x: torch.Tensor, rotary=None, kv_cache=None, attention_mask=None,
                attention_bias=None, encoder_output=None,
                cross_attention_mask=None) -> torch.Tensor:
        """`x [s, b, h]` (SP: `[s/tp, b, h]`) through the layers (and the final norm) -> same
        shape; the other arguments go to every layer (TransformerLayer.forward), `kv_cache`
        as each layer's own handle `kv_cache.layer(n)`."""
        args = (x, rotary, kv_cache, attention_mask, attention_bias, encoder_output,
                cross_attention_mask)
        if self.compiled_forward is not None:
            try:
                return self.compiled_forward(*args)
            except torch._dynamo.exc.TorchDynamoException as e:
                # raised while tracing: the eager rerun below starts again from `x` (a layer
                # that ran already rewrites the same cache slots with the same keys)
                self._compile_layers_instead(e)
        return self._forward(*args)

    def _forward(self, x, rotary, kv_cache, attention_mask, attention_bias, encoder_output,
                 cross_attention_mask):
        layers = list(self.layers.values())
        recompute = self.checkpoint_fn is not None and self.training and torch.is_grad_enabled()
        span_stop = dict(self.recompute_spans) if recompute else {}  # start -> stop
        extra = (attention_bias, encoder_output, cross_attention_mask)
        regions = self.compiled_forward is not None and torch.compiler.is_compiling()
        kwargs = dict(rotary=rotary, attention_mask=attention_mask,
                      attention_bias=attention_bias, encoder_output=encoder_output,
                      cross_attention_mask=cross_attention_mask)
        i = 0
        while i < len(layers):
            if i in span_stop:
                stop = span_stop[i]
                x = self.checkpoint_fn(_run_layers(layers[i:stop]), x, attention_mask, *extra,
                                       *(rotary if rotary is not None else ()))
                i = stop
                continue
            layer = layers[i]
            cache = kv_cache.layer(layer.layer_number) if kv_cache is not None else None
            if regions and not _has_forward_hooks(layer):  # the region skips __call__
                x = _LAYER_REGION(layer, x, kv_cache=cache, **kwargs)
            else:
                x = layer(x, kv_cache=cache, **kwargs)
            i += 1
        if self.final_layernorm is not None:
            x = self.final_layernorm(x)
        return x

    def _compile_layers_instead(self, error: Exception) -> None:
        """The layers would not trace as one region (a graph break inside a layer, which a
        nested compile region cannot hold): compile each layer on its own from now on."""
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        warnings.warn(f"torch.compile could not take the {len(self.layers)} layers of this "
                      f"stage as one compiled region ({reason}); compiling each layer on its "
                      f"own instead (slower: one compiled call per layer)", stacklevel=3)
        self.compiled_forward = None
        compile_transformer_layers(self, dynamic=self.compile_dynamic)


# Each layer's call inside a block compiled whole (compile_transformer_block): one nested
# compile region, called once per layer with the layer's weights as inputs. torch traces a
# region once and reuses it for the next layers when their inputs are tensors, numbers and
# modules only; a layer given a KV cache handle (the engine's) is traced each time, and
# inductor compiles the identical graphs once. Layers that differ in something traced as a
# constant (a sliding window on some layers only) get a variant each.
_LAYER_REGION = torch.compiler.nested_compile_region(TransformerLayer.forward,
                                                     max_reuse_entries=1024)


def _has_forward_hooks(layer: nn.Module) -> bool:
    """Whether calling `layer` runs forward hooks of its own or global ones (which the
    region, calling `TransformerLayer.forward` itself, would skip)."""
    from torch.nn.modules import module as module_globals

    return bool(layer._forward_hooks or layer._forward_pre_hooks
                or module_globals._global_forward_hooks
                or module_globals._global_forward_pre_hooks)


def _run_layers(layers):
    """`fn(x, attention_mask, attention_bias, encoder_output, cross_attention_mask, *rotary)
    -> x` through `layers`: a checkpointable unit (tensors as arguments; any may be None)."""
    def run(x, attention_mask, attention_bias, encoder_output, cross_attention_mask, *rotary):
        for layer in layers:
            x = layer(x, rotary=rotary or None, attention_mask=attention_mask,
                      attention_bias=attention_bias, encoder_output=encoder_output,
                      cross_attention_mask=cross_attention_mask)
        return x
    return run


def compile_transformer_layers(module: nn.Module, dynamic: bool | None = None) -> int:
    """`torch.compile` every TransformerLayer inside `module` in place (`nn.Module.compile`:
    parameter names and state dicts are unchanged), so inductor fuses each layer's elementwise
    chains (norms, RoPE, SwiGLU/GeLU, bias and residual adds, dropout) into generated kernels;
    matmuls and SDPA stay library calls (without grad, one query per row, inference's
    decode, takes inductor's loops instead of SDPA, and a short prefill float32 matmuls
    around a fused softmax: layers/attention.py `core_attention`). Layers share one
    compiled graph (same code and shapes); collectives and the RNG tracker's stream
    switches are graph breaks that run eagerly. In place and once: layers compiled already
    are left as they are. `dynamic` goes to `torch.compile` (None: a dimension becomes
    symbolic once it changes; True: every dimension symbolic from the start, except sizes
    0 and 1). Returns the number of layers compiled.

    Random numbers: inductor is told to draw them with torch's own kernels
    (`fallback_random`), so dropout masks are the eager ones and a compiled run matches an
    eager one, and every layout matches every other, as without compile.

    Raises `RuntimeError` before compiling anything when a layer sits on the CPU and no C++
    compiler is found (inductor generates C++ for CPU kernels; it looks for `CXX`, else g++).
    """
    _prepare_compile(module)
    layers = [m for m in module.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        # once only: a second torch.compile wrapper would not reuse the first one's graphs
        # (dynamo keys them by backend), so an engine built again would compile again
        if getattr(layer, "_compiled_call_impl", None) is None:
            layer.compile(dynamic=dynamic)
    return len(layers)


def compile_transformer_block(module: nn.Module, dynamic: bool | None = None) -> int:
    """`torch.compile` every TransformerBlock inside `module` whole, for inference: one
    compiled call runs all the block's layers and its final norm, each layer a nested
    compile region (`torch.compiler.nested_compile_region`) called once per layer, its
    weights as inputs (a layer with forward hooks of its own is called as a module, so they
    run; like any torch.compile, hooks registered after compiling are not seen: dynamo
    keeps no guard on them). Against one compiled call per layer
    (`compile_transformer_layers`) this saves per layer dynamo's guard checks and the
    compiled wrapper's entry (SmolLM2-135M on 2 CPU cores, ~100-300 us a layer): a
    one-row decode step 10-20% faster, a one-row prefill ~10% (2026-12-04;
    docs/PERFORMANCE.md). The first compile of each variant takes ~2-3x as long (the
    engine's layers are traced one by one: see `_LAYER_REGION`). Each block is compiled from
    its own copy of `_forward` (`_own_code`) and keeps dynamo's guards on the call's inputs,
    global state and `training` flags only (`_inputs_and_mode_guards`: the ~5,800 guards on
    its modules cost ~4 ms a one-row decode step). So a layer's Python attributes and hooks
    are read when a variant is compiled: one changed later (a window, a softcap, a hook) is
    not seen.

    A layer must trace without a graph break (a nested region cannot hold one). A block
    with a mixture-of-experts layer (its token counts per expert are Python ints: a break)
    is compiled per layer instead, as is a block whose layers were compiled one by one
    already; and should the layers of a block fail to trace as one region at any step
    (a `torch._dynamo` error while tracing; the step then reruns eagerly), the block warns and
    compiles per layer from then on. In place and once, like `compile_transformer_layers`;
    `dynamic` as there. Returns the number of layers compiled. Raises `RuntimeError` before
    compiling anything on a CPU without a C++ compiler."""
    _prepare_compile(module)
    count = 0
    for block in [m for m in module.modules() if isinstance(m, TransformerBlock)]:
        layers = list(block.layers.values())
        if block.compiled_forward is None:
            per_layer = any(isinstance(layer.mlp, MoELayer) or getattr(
                layer, "_compiled_call_impl", None) is not None for layer in layers)
            if per_layer:
                compile_transformer_layers(block, dynamic=dynamic)
            else:
                block.compiled_forward = torch.compile(
                    _own_code(block._forward), dynamic=dynamic,
                    options={"guard_filter_fn": _inputs_and_mode_guards, **_NO_INPUT_ASSERTS})
                block.compile_dynamic = dynamic  # for a fallback to per-layer compiling
        count += len(layers)
    return count


_BLOCKS_COMPILED = itertools.count()
# inductor's run-time checks of a compiled graph's inputs (sizes, strides, alignment, scalar
# ranges), ~25 a layer: dynamo's guards on the call's inputs check the same before the graph
# runs (`_inputs_and_mode_guards` keeps those), and a one-row decode step spent ~0.35 ms
# (of ~7) in them (SmolLM2-135M, 2-core Zen 4, 2026-12-07)
_NO_INPUT_ASSERTS = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}


def _own_code(method):
    """`method` (a bound `TransformerBlock._forward`) with a code object of its own: dynamo
    keeps its compiled variants and its recompile count per code object, so each block's
    graphs are found for that block alone (never another block's, of another model in the
    same process, whose guards would otherwise be all that tells them apart)."""
    f = method.__func__
    code = f.__code__.replace(co_name=f"{f.__name__}_{next(_BLOCKS_COMPILED)}")
    own = types.FunctionType(code, f.__globals__, code.co_name, f.__defaults__, f.__closure__)
    own.__kwdefaults__ = f.__kwdefaults__
    return types.MethodType(own, method.__self__)


def _inputs_and_mode_guards(guards) -> list[bool]:
    """dynamo's guard filter for a block compiled by `compile_transformer_block` (its own code
    object, `_own_code`): keep the guards on the call's inputs and global state, and of the
    guards on the block's own modules only `training`. The ~5,800 others (SmolLM2-135M: each
    parameter's size and stride, each module's empty hook dicts, each Python attribute)
    re-check, every step, a structure that does not change while serving; evaluating them
    took ~4 ms of a ~11 ms one-row decode step (2-core Zen 4, 2026-12-07). So, as with nested
    regions, a layer attribute or hook changed after compiling is not seen."""
    return [not g.orig_guard.source.is_unspecialized_nn_module() or g.name.endswith(".training")
            for g in guards]


def _prepare_compile(module: nn.Module) -> None:
    """What both compile functions do first: refuse a CPU without a C++ compiler
    (`RuntimeError`, before compiling anything) and have inductor draw random numbers with
    torch's own kernels (`fallback_random`: dropout masks equal eager ones)."""
    import torch._inductor.config as inductor_config

    problem = cpp_compiler_problem() if any(
        p.device.type == "cpu" for p in module.parameters()) else None
    if problem:
        raise RuntimeError(problem)
    inductor_config.fallback_random = True


def cpp_compiler_problem() -> str | None:
    """None when inductor finds a C++ compiler (for CPU kernels), else the message saying how
    to get one (its search is cached: cheap after the first call)."""
    from torch._inductor import cpp_builder
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        cpp_builder.get_cpp_compiler()
    except InvalidCxxCompiler:
        tried = f" (CXX={os.environ['CXX']} does not run)" if os.environ.get("CXX") else ""
        return (f"--compile on CPU needs a C++ compiler (inductor generates C++ kernels) and "
                f"none was found{tried}: install one (e.g. `apt install g++`), or point CXX at "
                f"it, or drop --compile")
    return None
