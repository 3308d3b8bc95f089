"""Activation bytes per rank, predicted from the layer code and from the paper.

Predicted, per transformer layer, `s` sequence, `b` micro batch, `h` hidden, `a` heads, `t` TP:

- `paper_layer_bytes`: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", sec. 4 and Table 2: `sbh(34 + 5as/h)` bytes without parallelism,
  `sbh(10 + 24/t + 5as/(ht))` with TP, `sbh(34/t + 5as/(ht))` with TP + SP, without the `5as/h`
  term under selective recompute, and `2sbh` (the layer input; `/t` under SP) under full
  recompute. The paper assumes 2-byte activations and 1-byte dropout masks; with
  `bytes_per_value=4` (float32) every activation doubles and masks stay 1 byte, e.g.
  `sbh(66 + 9as/h)` without parallelism. Its GPT has GeLU, LayerNorm, biases, MHA and a
  materialized `s x s` softmax.
- `model_layer_bytes`: what *our* layer saves, term by term (read off the saved tensors of
  layers/transformer.py on CPU): SwiGLU or GeLU, GQA, RMSNorm or LayerNorm, SDPA (flash on
  CPU without dropout: q, k, v, output and log-sum-exp, no `s x s`; with dropout keyed by
  sample, the default, the explicit softmax: the float32 probabilities, the mask and the
  dropped probabilities; with Megatron's stream dropout SDPA's math kernel: scaled q and k,
  softmax, float mask and dropped probabilities), dropout masks of the activation dtype
  (`input * mask` with a float mask, as CPU `F.dropout` keeps), and under SP
  the column-parallel linears keep only the sequence shard of their input and all-gather it
  again in backward (as Megatron). Change it with the layer code; the tests compare it to
  the measurement at several shapes.
training/memory.py measures the same quantities on a real microbatch and reports both.
"""
from __future__ import annotations

from dataclasses import dataclass

from layers.mlp import GATED
from layers.recompute import recompute_spans

from .mla import mla_attention_bytes
from .moe import moe_layer_bytes


def paper_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                      recompute: str | None = None, bytes_per_value: int = 2,
                      mask_bytes: int = 1) -> float:
    """Korthikanti et al. 2022, Table 2, per layer, in bytes (see the module docstring).

    With 2-byte values: replicated `10sbh` (two norm inputs, QKV and fc1 inputs: 4sbh values;
    two hidden dropout masks: 2sbh), TP-sharded `24sbh/t` (Q, K, V, projection input, GeLU
    input, fc2 input: 12sbh values), core attention `5as^2b/t` (softmax and dropout output:
    2as^2b values; the mask: as^2b). SP divides the replicated part by t as well.
    """
    e, sbh = bytes_per_value, s * b * h
    if recompute == "full":
        return e * sbh / (t if sp else 1)
    replicated = (4 * e + 2 * mask_bytes) * sbh
    sharded = 12 * e * sbh
    core = 0 if recompute == "selective" else (2 * e + mask_bytes) * a * s * s * b
    return replicated / (t if sp else 1) + (sharded + core) / t


def norm_bytes(config, tokens: int, bytes_per_value: int, frozen: bool = False) -> int:
    """What one norm saves for backward over `tokens` rows of `config.hidden_size`, in bytes.

    RMSNorm: its float32 input copy and rstd (layers/norm.py computes in float32; in float32
    F.rms_norm keeps the same two) and the normalized input in the activation dtype, which the
    weight's product keeps (not when the weight is `frozen`, a LoRA base's). LayerNorm
    (F.layer_norm on CPU): the input, and mean and rstd in the activation dtype.
    """
    h, e = config.hidden_size, bytes_per_value
    if config.normalization == "RMSNorm":
        return tokens * (4 * h + 4 + (0 if frozen and not config.layernorm_zero_centered_gamma
                                      else e * h))
    return e * tokens * (h + 2)


def qk_norm_bytes(config, tokens: int, heads: int, groups: int, d: int, e: int) -> int:
    """What a layer's q/k norms (`qk_layernorm`, layers/attention.py) save beyond the layer
    without them, for `tokens` rows and this rank's `heads` query and `groups` KV heads of
    width `d`, `e` bytes a value: the normed q and k joined (RoPE's input), the float32 rstd
    of each row normalized, a float32 copy of the input in a lower precision; over the whole
    projection (ProjectionRMSNorm) also the float32 normalized values and, in a lower
    precision, the float32 weights. Measured with training.memory.SavedTensorMeter
    (tests/test_hf_dense_families.py)."""
    values = tokens * (heads + groups) * d
    low = e != 4
    if config.qk_norm_over_heads:
        return 8 * values + 4 * 2 * tokens + (4 * (heads + groups) * d if low else 0)
    return 4 * values + 4 * tokens * (heads + groups) + (e * values if low else 0)


def model_layer_bytes(config, s: int, b: int, t: int = 1, sp: bool = False,
                      recompute: str | None = None, bytes_per_value: int = 4,
                      dropout: bool | None = None, keyed_dropout: bool = True,
                      sliding: bool = False, moe: bool = False, ep: int = 1,
                      context_parallel: bool = False, lora: "FrozenBase | None" = None,
                      live: bool = True) -> dict:
    """What one of our transformer layers saves for backward, term by term, in bytes (see the
    module docstring). `dropout`: whether dropout is active (default: from the config);
    `keyed_dropout`: masks keyed by sample (`--dropout-masks sample`: the attention takes the
    explicit softmax) rather than drawn from streams (SDPA's math kernel); `sliding`: the
    layer has a sliding window (its mask is the chunk's shared one: `model_chunk_bytes`);
    `moe`: its MLP is a mixture of experts (`planner.moe.moe_layer_bytes` replaces the MLP's
    terms; `ep` the expert-parallel size); `context_parallel`: `s` is a CP rank's part of
    the sequence and the core attention is layers/context_parallel's, which saves q, k, v,
    its output and the float32 log-sum-exp (no `s x s` term, with or without dropout: its
    masks are redrawn in backward), and the projection reads a view of the output.
    `lora`: the base is frozen and adapters train (`FrozenBase`; a dense layer's terms then
    follow `_frozen_base_terms`, `live` saying whether the layer's input needs a gradient).
    Returns `{term: bytes}`; `sum(...values())` is the layer's total.
    """
    e, h, d = bytes_per_value, config.hidden_size, config.kv_channels
    an, gn, f = config.num_attention_heads // t, config.num_query_groups // t, \
        config.ffn_hidden_size // t
    sl = s // t if sp else s  # sequence length of norms and dropout (a shard under SP)
    if recompute == "full":
        return {"layer input": e * sl * b * h}
    hid_drop = config.hidden_dropout > 0 if dropout is None else dropout
    att_drop = config.attention_dropout > 0 if dropout is None else dropout
    norms = 2 * config.pre_layernorm + config.post_self_attn_layernorm + config.post_mlp_layernorm
    out = {"norms": norms * norm_bytes(config, sl * b, e),
           "qkv and fc1 inputs": 2 * e * sl * b * h}  # the sequence shard under SP
    if config.multi_latent_attention:  # planner/mla.py
        out.update(mla_attention_bytes(config, s, b, t, sp, recompute, e, att_drop,
                                       keyed_dropout, context_parallel))
    else:
        out.update(_attention_terms(config, s, b, an, gn, d, e, recompute, att_drop,
                                    keyed_dropout, sliding, context_parallel))
    if config.qk_layernorm:
        out["q/k norms"] = qk_norm_bytes(config, s * b, an, gn, d, e)
    if moe:  # the MoE MLP's own terms; the pre-MLP norm's output is the router's input
        out["qkv and fc1 inputs"] //= 2
        out.update(moe_layer_bytes(config, s, b, t, sp, e, ep))
    else:
        per_row = {"swiglu": 4, "quick_geglu": 7}.get(config.activation, 2)  # planner.moe's
        out["mlp"] = e * s * b * per_row * f
    if hid_drop:
        out["hidden dropout masks"] = 2 * e * sl * b * h
    if lora is not None and not moe:
        out = _frozen_base_terms(config, out, lora, live, e=e, s=s, sl=sl, b=b,
                                 q=e * s * b * an * d, f=f,
                                 hid_drop=hid_drop)
    return out


def _attention_terms(config, s: int, b: int, an: int, gn: int, d: int, e: int,
                     recompute: str | None, att_drop: bool, keyed_dropout: bool,
                     sliding: bool, context_parallel: bool) -> dict:
    """`model_layer_bytes`' attention terms of a SelfAttention layer: `an` query and `gn` KV
    heads of this rank, head dim `d`, `e` bytes a value (see that function)."""
    out = {}
    mixed = e * s * b * (an + 2 * gn) * d  # fused QKV output: v (and q, k without RoPE) view it
    rope = config.position_embedding_type == "rope"
    sinks = getattr(config, "softmax_type", "vanilla") == "learnable"  # gpt-oss: explicit
    q, kv_heads = e * s * b * an * d, e * s * b * gn * d
    if context_parallel:  # selective: the checkpoint keeps q, k, v and returns the output
        out["attention q, k, v"] = mixed + (q + kv_heads if rope else 0)
        if recompute != "selective":  # the projection reads a view of the saved output
            out["attention output"] = q
            out["attention log-sum-exp"] = 4 * b * an * s
        else:
            out["projection input"] = q
    elif recompute == "selective" or not att_drop:
        # flash kernel (or the inputs kept by the checkpoint): q, k, v and the output, which
        # the projection reads without a copy (selective: the projection input).
        out["attention q, k, v"] = mixed + (q + kv_heads if rope else 0)
        out["attention output"] = q
        if recompute != "selective" and sinks:  # the explicit softmax: its float32 output
            # [s, s + 1] (the sink's column) and the causal mask's complement (bool s x s)
            out["attention s^2 (softmax with sinks)"] = 4 * b * an * s * (s + 1) + \
                (0 if sliding else s * s)
        elif recompute != "selective":
            out["attention log-sum-exp"] = 4 * b * an * s
    elif keyed_dropout:  # the explicit softmax (layers/attention.py `core_attention`): q
        # reshaped for grouped heads (a copy under GQA, else a view of RoPE's q copy or of
        # the fused output), k and v viewed in place (the fused output, or RoPE's k copy);
        # the float32 softmax output, the mask and the dropped probabilities (activation
        # dtype) and the causal mask's complement (bool s x s; a sliding layer adds its
        # additive mask, which keeps nothing); the projection reads a copy of the output
        own_q = rope or an != gn
        out["attention q, k, v"] = mixed + (q if own_q else 0) + (kv_heads if rope else 0)
        out["attention s^2 (softmax, mask, dropped)"] = 4 * b * an * s * (s + sinks) + \
            2 * e * b * an * s * s + (0 if sliding else s * s)
        out["projection input"] = q
    else:  # math kernel with dropout, which on CPU computes in float32 (a bf16 input is
        # upcast): scaled q and k copies; v viewing the fused output in float32, else its
        # float32 copy (expanded to the query heads under GQA); the s x s softmax, float mask
        # and dropped probabilities; the projection reads a copy of the output
        q32 = 4 * s * b * an * d
        out["attention q, k, v"] = 2 * q32 + (mixed if e == 4 and an == gn else q32)
        out["attention s^2 (softmax, mask, dropped)"] = 3 * 4 * b * an * s * s
        out["projection input"] = q
    return out


@dataclass(frozen=True)
class FrozenBase:
    """A LoRA run's layers (layers/lora.py `add_lora`): every base weight frozen, adapters of
    `rank` on the HF `parts` (`layers.lora.resolve_targets`), `dropout` on their inputs."""

    parts: tuple[str, ...]
    rank: int
    dropout: float = 0.0

    @classmethod
    def of(cls, train) -> "FrozenBase | None":
        """The LoRA settings of TrainConfig `train` (None without --lora-rank)."""
        from layers.lora import resolve_targets

        return cls(resolve_targets(train.lora_target_modules), train.lora_rank,
                   train.lora_dropout) if train.lora_rank else None


def _frozen_base_terms(config, full: dict, lora: FrozenBase, live: bool, *, e: int, s: int,
                       sl: int, b: int, q: int, f: int, hid_drop: bool) -> dict:
    """`model_layer_bytes`' terms for a layer whose base is frozen (measured per module with
    saved-tensor hooks, tests/test_lora_memory.py): a frozen linear keeps no input (layers/
    linear.py: its input serves only the weight gradient); a frozen RMSNorm weight keeps
    no normalized input (the float32 input copy and rstd stay); each adapted part keeps its
    `u = A x` `[s, b, r]` (B's input; gathered under SP) and its input: the linear's input
    itself, or with adapter dropout its own dropped copy plus the mask (the mask only where
    the input needs a gradient). `live`: the layer's input needs a gradient (not the first
    layer after a frozen embedding); until the first adapted module nothing in the layer
    does, so nothing before it is kept."""
    parts, gated = set(lora.parts), config.activation in GATED
    n_qkv = sum(p in parts for p in ("q_proj", "k_proj", "v_proj"))
    n_fc1 = sum(p in parts for p in (("gate_proj", "up_proj") if gated else ("up_proj",)))
    proj, fc2 = "o_proj" in parts, "down_proj" in parts
    att_live = live or n_qkv > 0  # q, k, v need a gradient
    mid_live = att_live or proj  # the residual after attention
    mlp_live = mid_live or n_fc1 > 0
    h, rows = config.hidden_size, sl * b
    out = {"norms": (live + mid_live) * norm_bytes(config, rows, e, frozen=True)}
    selective = "attention log-sum-exp" not in full and "attention output" in full
    if att_live:  # under selective recompute the attention's output is the projection's input
        out.update({k: v for k, v in full.items() if (k.startswith("attention")
                    or k == "q/k norms") and not (selective and k == "attention output")})
    if mlp_live:  # SwiGLU keeps fc1's output and silu(gate); GeLU its input
        out["mlp internals"] = e * s * b * (3 * f if config.activation == "swiglu" else f)
    kept_output = att_live and "attention output" in out  # what the projection reads
    inputs = 0
    for n, size, needs_grad, saved in ((n_qkv, e * rows * h, live, False),
                                       (n_fc1, e * rows * h, mid_live, False),
                                       (int(proj), q, att_live, kept_output),
                                       (int(fc2), e * s * b * f, mlp_live, False)):
        if n and lora.dropout > 0:  # a dropped copy per part, and its mask
            inputs += n * size * (1 + needs_grad)
        elif n and not saved:
            inputs += size
    out["linear inputs (adapted)"] = inputs
    out["adapters' A x"] = e * s * b * lora.rank * (n_qkv + n_fc1 + proj + fc2)
    if hid_drop:
        out["hidden dropout masks"] = e * rows * h * (mid_live + (mlp_live or fc2))
    return out


def model_chunk_bytes(config, num_layers: int, s: int, b: int, t: int = 1, sp: bool = False,
                      granularity: str | None = None, method: str | None = None,
                      recompute_num_layers: int | None = None, bytes_per_value: int = 4,
                      dropout: bool | None = None, keyed_dropout: bool = True,
                      layer_numbers: list[int] | None = None, ep: int = 1,
                      context_parallel: bool = False, lora: FrozenBase | None = None,
                      frozen_input: bool = False) -> int:
    """Predicted bytes of a chunk's decoder layers (the "layers" region of the meter): per-layer
    terms under the recompute policy, plus the RoPE cos/sin tables shared by all layers, plus
    the sliding-window mask (`[1, 1, s, s]`, activation dtype, made once per forward by
    GPTModel) when a sliding layer outside a fully recomputed span keeps it: the flash
    kernel and selective recompute's checkpoint keep one shared copy; the explicit
    (attention sinks: always) and math softmaxes keep none. `layer_numbers`: the chunk's
    global layers (default 0..num_layers-1), which say which layers slide
    (`ModelConfig.layer_window_size`) and which are MoE; `ep` the expert-parallel size.
    `context_parallel`: `s` is a CP rank's part of the sequence (see `model_layer_bytes`);
    no window mask is made, and the RoPE tables are per row (`[s, b, 1, d]`: the tokens'
    global positions). `lora`: a LoRA run's frozen base (`FrozenBase`); `frozen_input`: the
    chunk's input needs no gradient (it follows the frozen embedding), so its first layer
    keeps nothing before its first adapter."""
    kw = dict(s=s, b=b, t=t, sp=sp, bytes_per_value=bytes_per_value, dropout=dropout,
              keyed_dropout=keyed_dropout, ep=ep, context_parallel=context_parallel, lora=lora)
    numbers = range(num_layers) if layer_numbers is None else layer_numbers
    kinds = [(config.layer_window_size(n) is not None, config.is_moe_layer(n))
             for n in numbers]  # (slides, moe)
    if granularity == "full":
        spans = recompute_spans(num_layers, method or "uniform", recompute_num_layers or 1)
        inside = {i for start, stop in spans for i in range(start, stop)}
        kept = [(i, kind) for i, kind in enumerate(kinds) if i not in inside]
        total = len(spans) * sum(model_layer_bytes(config, recompute="full", **kw).values())
    else:
        kept = list(enumerate(kinds))
        total = 0
    total += sum(sum(model_layer_bytes(config, recompute=granularity if granularity != "full"
                                       else None, sliding=slides, moe=moe,
                                       live=not (frozen_input and i == 0), **kw).values())
                 for i, (slides, moe) in kept)
    kept = [kind for _, kind in kept]
    att_drop = config.attention_dropout > 0 if dropout is None else dropout
    explicit = getattr(config, "softmax_type", "vanilla") == "learnable"  # sinks: no flash
    if any(slides for slides, _ in kept) and (granularity == "selective" or not att_drop) \
            and not context_parallel and (granularity == "selective" or not explicit):
        total += bytes_per_value * s * s
    if config.position_embedding_type == "rope" and num_layers:  # float32 cos, sin
        # MLA rotates its decoupled RoPE part only (ModelConfig.rotary_dim)
        total += 2 * 4 * s * config.rotary_dim * (b if context_parallel else 1)
    return total
