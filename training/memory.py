"""Memory per rank: model states (ZeRO stages, offload) and activations, each measured beside
its formula.

Model states (`model_state_bytes`): the bytes of the tensors that live for the whole run,
read off the tensors themselves, beside ZeRO's formulas (Rajbhandari et al. 2020, sec. 3.1 and
5) for the sharding strategy of training/distributed.py, and the gathered-parameter peak of
ZeRO-3 (training/fsdp.py).

Activations, measured: the bytes autograd keeps for backward during one microbatch's forward,
counted with `torch.autograd.graph.saved_tensors_hooks` over unique storages (a view, or a
tensor saved by two ops, counts once; a view keeps its whole storage alive, so the storage is
what is counted).
Parameter storages are not activations and are skipped. Inside a recomputed region
`torch.utils.checkpoint` installs its own hook, so only what it really keeps (the region's
inputs) is seen, which is the point.

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
"""
from __future__ import annotations

import contextlib
import resource

import torch

import parallel_state as ps

from .distributed import STRATEGIES  # ZeRO stages 0-3, in order
from .recompute import recompute_spans


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: CUDA max allocated bytes, or peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


class SavedTensorMeter:
    """Context manager: unique storage bytes saved for backward while active, by region.

    Regions: "layers" (inside a TransformerBlock's layers, including recompute inputs at the
    block level) and "other" (embedding, final norm, output layer, loss).

    Args:
        chunks: the model chunks run inside the context (their parameters are excluded and
            their `decoder` blocks define the "layers" region).
    """

    def __init__(self, chunks):
        self.param_list = [p for c in chunks for p in c.parameters()]
        self.params = self._param_storages()
        self.chunks = chunks
        self.storages: dict[int, tuple[int, str]] = {}
        self.region = "other"
        self._handles = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _param_storages(self) -> set[int]:
        return {p.untyped_storage().data_ptr() for p in self.param_list}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in self.storages and ptr not in self.params:
            self.params = self._param_storages()  # ZeRO-3 re-allocates gathered parameters
        if ptr and ptr not in self.params and ptr not in self.storages:
            self.storages[ptr] = (storage.nbytes(), self.region)
        return t

    def _set(self, region: str):
        def hook(*_):
            self.region = region
        return hook

    def __enter__(self) -> "SavedTensorMeter":
        for c in self.chunks:
            block = c.decoder
            self._handles += [block.register_forward_pre_hook(self._set("layers")),
                              block.register_forward_hook(self._set("other"))]
            if block.final_layernorm is not None:
                self._handles.append(
                    block.final_layernorm.register_forward_pre_hook(self._set("other")))
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles = []

    def bytes(self, region: str | None = None) -> int:
        return sum(n for n, r in self.storages.values() if region is None or r == region)


@contextlib.contextmanager
def _rng_untouched():
    """Restore the default generator and the RNG tracker afterwards, so that a measurement
    does not change the dropout masks of the run."""
    tracker = ps.get_rng_tracker()
    cpu, states = torch.get_rng_state(), tracker.get_states()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        tracker.set_states(states)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def measure_activation_bytes(chunks, batch: dict, hidden_shape, dtype=torch.float32) -> dict:
    """Saved-for-backward bytes of one microbatch through this rank's model chunks.

    Each chunk runs forward (training mode) on `batch` (`tokens`, `labels`); a chunk without
    the embedding gets a zero `hidden_shape` input (`[s, b, h]`, `[s/tp, b, h]` under SP) of
    `dtype`, which is what it would receive from the previous stage. RNG states are restored.
    Returns `{"total", "layers", "num_layers", "layer_numbers"}` (bytes, bytes in decoder
    layers, layers, their global numbers).
    """
    from .schedules import loss_from_batch

    modules = [getattr(c, "module", c) for c in chunks]
    device = batch["tokens"].device
    # every chunk's output stays referenced until all are measured: a freed graph's storages
    # would be reused by the next chunk at the same addresses and be counted once
    outputs = []
    # the batch's sample ids key dropout as in training (layers/dropout.py: the attention then
    # takes the explicit softmax), so the measurement sees what a training step saves
    with _rng_untouched(), ps.dropout_sample_ids(batch.get("sample_ids")), \
            SavedTensorMeter(modules) as meter:
        for chunk, module in zip(chunks, modules):
            hidden = None if module.pre_process else torch.zeros(
                hidden_shape, dtype=dtype, device=device, requires_grad=True)
            outputs.append(loss_from_batch(chunk, batch, hidden_states=hidden))
    del outputs
    return {"total": meter.bytes(), "layers": meter.bytes("layers"),
            "num_layers": sum(len(m.decoder.layers) for m in modules),
            "layer_numbers": [int(n) for m in modules for n in m.decoder.layers]}


# ---------------------------------------------------------------------- formulas
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


def norm_bytes(config, tokens: int, bytes_per_value: int) -> int:
    """What one norm saves for backward over `tokens` rows of `config.hidden_size`, in bytes.

    RMSNorm: its float32 input copy and rstd (layers/norm.py computes in float32; in float32
    F.rms_norm keeps the same two) and the normalized input in the activation dtype, which the
    weight's product keeps. LayerNorm (F.layer_norm on CPU): the input, and mean and rstd in
    the activation dtype.
    """
    h, e = config.hidden_size, bytes_per_value
    if config.normalization == "RMSNorm":
        return tokens * (4 * h + 4 + e * h)
    return e * tokens * (h + 2)


def model_layer_bytes(config, s: int, b: int, t: int = 1, sp: bool = False,
                      recompute: str | None = None, bytes_per_value: int = 4,
                      dropout: bool | None = None, keyed_dropout: bool = True,
                      sliding: bool = False) -> dict:
    """What one of our transformer layers saves for backward, term by term, in bytes (see the
    module docstring). `dropout`: whether dropout is active (default: from the config);
    `keyed_dropout`: masks keyed by sample (`--dropout-masks sample`: the attention takes the
    explicit softmax) rather than drawn from streams (SDPA's math kernel); `sliding`: the
    layer has a sliding window (its mask is the chunk's shared one: `model_chunk_bytes`).
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
    out = {"norms": 2 * norm_bytes(config, sl * b, e),
           "qkv and fc1 inputs": 2 * e * sl * b * h}  # the sequence shard under SP
    mixed = e * s * b * (an + 2 * gn) * d  # fused QKV output: v (and q, k without RoPE) view it
    rope = config.position_embedding_type == "rope"
    q, kv_heads = e * s * b * an * d, e * s * b * gn * d
    if recompute == "selective" or not att_drop:
        # flash kernel (or the inputs kept by the checkpoint): q, k, v and the output, which
        # the projection reads without a copy (selective: the projection input).
        out["attention q, k, v"] = mixed + (q + kv_heads if rope else 0)
        out["attention output"] = q
        if recompute != "selective":
            out["attention log-sum-exp"] = 4 * b * an * s
    elif keyed_dropout:  # the explicit softmax (layers/attention.py `core_attention`): q
        # reshaped for grouped heads (a copy under GQA, else a view of RoPE's q copy or of
        # the fused output), k and v viewed in place (the fused output, or RoPE's k copy);
        # the float32 softmax output, the mask and the dropped probabilities (activation
        # dtype) and the causal mask's complement (bool s x s; a sliding layer adds its
        # additive mask, which keeps nothing); the projection reads a copy of the output
        own_q = rope or an != gn
        out["attention q, k, v"] = mixed + (q if own_q else 0) + (kv_heads if rope else 0)
        out["attention s^2 (softmax, mask, dropped)"] = (4 + 2 * e) * b * an * s * s + \
            (0 if sliding else s * s)
        out["projection input"] = q
    else:  # math kernel with dropout, which on CPU computes in float32 (a bf16 input is
        # upcast): scaled q and k copies; v viewing the fused output in float32, else its
        # float32 copy (expanded to the query heads under GQA); the s x s softmax, float mask
        # and dropped probabilities; the projection reads a copy of the output
        q32 = 4 * s * b * an * d
        out["attention q, k, v"] = 2 * q32 + (mixed if e == 4 and an == gn else q32)
        out["attention s^2 (softmax, mask, dropped)"] = 3 * 4 * b * an * s * s
        out["projection input"] = q
    out["mlp"] = e * s * b * (4 * f if config.activation == "swiglu" else 2 * f)
    if hid_drop:
        out["hidden dropout masks"] = 2 * e * sl * b * h
    return out


def model_chunk_bytes(config, num_layers: int, s: int, b: int, t: int = 1, sp: bool = False,
                      granularity: str | None = None, method: str | None = None,
                      recompute_num_layers: int | None = None, bytes_per_value: int = 4,
                      dropout: bool | None = None, keyed_dropout: bool = True,
                      layer_numbers: list[int] | None = None) -> int:
    """Predicted bytes of a chunk's decoder layers (the "layers" region of the meter): per-layer
    terms under the recompute policy, plus the RoPE cos/sin tables shared by all layers, plus
    the sliding-window mask (`[1, 1, s, s]`, activation dtype, made once per forward by
    GPTModel) when a sliding layer outside a fully recomputed span keeps it: the flash kernel
    and selective recompute's checkpoint keep one shared copy; the explicit and math softmaxes
    keep none. `layer_numbers`: the chunk's global layers (default 0..num_layers-1), which
    say which layers slide (`ModelConfig.layer_window_size`)."""
    kw = dict(s=s, b=b, t=t, sp=sp, bytes_per_value=bytes_per_value, dropout=dropout,
              keyed_dropout=keyed_dropout)
    numbers = range(num_layers) if layer_numbers is None else layer_numbers
    sliding = [config.layer_window_size(n) is not None for n in numbers]
    if granularity == "full":
        spans = recompute_spans(num_layers, method or "uniform", recompute_num_layers or 1)
        inside = {i for start, stop in spans for i in range(start, stop)}
        kept = [slides for i, slides in enumerate(sliding) if i not in inside]
        total = len(spans) * sum(model_layer_bytes(config, recompute="full", **kw).values())
    else:
        kept = sliding
        total = 0
    total += sum(sum(model_layer_bytes(config, recompute=granularity if granularity != "full"
                                       else None, sliding=slides, **kw).values())
                 for slides in kept)
    att_drop = config.attention_dropout > 0 if dropout is None else dropout
    if any(kept) and (granularity == "selective" or not att_drop):
        total += bytes_per_value * s * s
    if config.position_embedding_type == "rope" and num_layers:
        total += 2 * 4 * s * config.kv_channels  # float32 cos, sin [s, 1, 1, d]
    return total


def activation_report(config, measured: dict, *, micro_batch_size: int, tp: int, sp: bool,
                      granularity, method, recompute_num_layers, dtype=torch.float32,
                      dropout: bool | None = None, keyed_dropout: bool = True) -> dict:
    """Record of measured vs predicted activation bytes per microbatch on this rank."""
    s, b, n = config.seq_length, micro_batch_size, measured["num_layers"]
    e = torch.tensor([], dtype=dtype).element_size()
    model = model_chunk_bytes(config, n, s, b, tp, sp, granularity, method, recompute_num_layers,
                              e, dropout, keyed_dropout, measured.get("layer_numbers"))
    per_layer = paper_layer_bytes(s, b, config.hidden_size, config.num_attention_heads, tp, sp,
                                  granularity, bytes_per_value=e)
    if granularity == "full":
        spans = recompute_spans(n, method or "uniform", recompute_num_layers or 1)
        inside = sum(stop - start for start, stop in spans)
        paper = len(spans) * per_layer + (n - inside) * paper_layer_bytes(
            s, b, config.hidden_size, config.num_attention_heads, tp, sp, None,
            bytes_per_value=e)
    else:
        paper = n * per_layer
    return {"activation_bytes_per_microbatch": measured["total"],
            "activation_bytes_layers": measured["layers"],
            "activation_bytes_layers_model_predicted": model,
            "activation_bytes_layers_paper_predicted": paper,
            "num_layers": n}


# ---------------------------------------------------------------------- model states
def model_state_bytes(model, optimizer) -> dict:
    """Exact per-rank bytes of model states, read off the tensors (ZeRO's accounting,
    Rajbhandari et al. 2020, sec. 3.1), beside their formulas.

    Measured (bytes): `params` (the persistent weights: the parameters, the flat parameter
    buffer of ZeRO-1/2 or the parameter shards of ZeRO-3), `grads` (the float32 gradient
    buffer, or the gradient shards of ZeRO-2/3), `main_params` (float32 copies separate from
    the weights), `optimizer_states` (AdamW moments), their sum `total`, and in host memory
    (--optimizer-cpu-offload) `host_main_params`, `host_optimizer_states`, `host_grads` and
    `host_total`. Padding to multiples of dp is included: it is allocated.

    Formulas: `predicted_total` / `predicted_host_total` = `zero_formula_bytes` with the padded
    parameter count (must equal the measurement exactly); `paper_total` with the unpadded one
    (the paper's, e.g. `(W + G + K) psi / N_d` for stage 3). Under ZeRO-3 also
    `gathered_params_predicted_peak` (training/fsdp.py).

    `model`: the DistributedDataParallel wrappers of this rank's chunks; `optimizer`: a
    `DistributedOptimizer`, or a torch AdamW (no_shard in float32) whose lazily created moments
    are counted as AdamW will allocate them.
    """
    from .distributed_optimizer import DistributedOptimizer

    def size(t):
        return 0 if t is None else t.numel() * t.element_size()

    params = [p for d in model for p in d.params]
    out = {"params": sum(size(d.param_shards) if d.param_shards is not None else
                         size(d.param_buffer) if d.param_buffer is not None else
                         sum(size(p) for p in d.params) for d in model),
           "grads": sum(size(d.grad_shards) if d.shard_grads else size(d.buffer.data)
                        for d in model)}
    if isinstance(optimizer, DistributedOptimizer):
        out.update(optimizer.state_bytes())
        n_host = sum(s.hi - s.lo for s in optimizer.shards if s.host)
    else:
        out.update(main_params=0, optimizer_states=2 * sum(size(p) for p in params),
                   host_main_params=0, host_optimizer_states=0, host_grads=0)
        n_host = 0
    out["total"] = out["params"] + out["grads"] + out["main_params"] + out["optimizer_states"]
    out["host_total"] = out["host_main_params"] + out["host_optimizer_states"] + out["host_grads"]
    strategy = model[0].strategy if model else "no_shard"
    dp = model[0].dp_size if model else 1
    weight = params[0].element_size() if params else 4
    # a separate fp32 main copy: bf16 weights, or mixed precision without a parameter store
    main_copy = weight != 4 or (strategy == "no_shard" and isinstance(optimizer,
                                                                     DistributedOptimizer))
    psi, padded = sum(p.numel() for p in params), sum(d.numel_padded for d in model)
    kw = dict(strategy=strategy, dp=dp, weight_bytes=weight, main_copy=main_copy,
              host_elements=n_host)
    out["predicted_total"], out["predicted_host_total"] = zero_formula_bytes(padded, **kw)
    out["paper_total"] = zero_formula_bytes(psi, **kw)[0]
    out.update(psi=psi, psi_padded=padded, dp=dp, strategy=strategy)
    for name in STRATEGIES:  # what each strategy would hold for this rank's parameters
        out[f"paper_total_{name}"] = zero_formula_bytes(
            psi, strategy=name, dp=dp, weight_bytes=weight,
            main_copy=weight != 4 or (name == "no_shard" and main_copy))[0]
    if model and model[0].units is not None:
        out["gathered_params_predicted_peak"] = sum(d.units.predicted_peak_bytes() for d in model)
    return out


def zero_formula_bytes(psi: int, *, strategy: str, dp: int, weight_bytes: int,
                       main_copy: bool, host_elements: int = 0) -> tuple[int, int]:
    """(device, host) model-state bytes per rank for `psi` parameters on this rank (ZeRO,
    Rajbhandari et al. 2020, sec. 5, with our byte counts): weights W = 2 (bf16) or 4 (fp32),
    gradients G = 4 (accumulated in fp32), optimizer K = 8 (two Adam moments) plus 4 for a
    separate fp32 main copy (`main_copy`: bf16 weights, or no flat parameter store), so K = 12
    in bf16 as in the paper. Per strategy, with N_d = dp:

    - no_shard (stage 0): `(W + G + K) psi`
    - optim (stage 1): `(W + G) psi + K psi / N_d`
    - optim_grads (stage 2): `W psi + (G + K) psi / N_d`
    - optim_grads_params (stage 3): `(W + G + K) psi / N_d`

    With offload, `host_elements` of the optimizer's `psi / N_d` (`psi` unsharded) elements
    move to host memory with 16 bytes each (fp32 main copy, two moments, gradient copy).
    """
    n_opt = psi // dp if strategy != "no_shard" else psi
    w = weight_bytes * (psi // dp if strategy == "optim_grads_params" else psi)
    g = 4 * (psi // dp if strategy in ("optim_grads", "optim_grads_params") else psi)
    k = (8 + 4 * main_copy) * (n_opt - host_elements)
    return w + g + k, 16 * host_elements

