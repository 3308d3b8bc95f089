"""Memory per rank: model states (ZeRO stages, offload) and activations, each measured beside
its formula.

Model states (`model_state_bytes`): the bytes of the tensors that live for the whole run,
read off the tensors themselves, beside ZeRO's formulas (Rajbhandari et al. 2020, sec. 3.1 and
5) for the sharding strategy of data_parallel/ddp.py, and the gathered-parameter peak of
ZeRO-3 (data_parallel/fsdp.py).

Activations, measured: the bytes autograd keeps for backward during one microbatch's forward,
counted with `torch.autograd.graph.saved_tensors_hooks` over unique storages (a view, or a
tensor saved by two ops, counts once; a view keeps its whole storage alive, so the storage is
what is counted).
A storage counts when a graph still holds it as the meter closes (keep the outputs
referenced until then): a region that saves its inputs but whose output needs no gradient (a
checkpointed attention before a LoRA model's first adapter) drops them at once, and a later
storage at the same address is a new one. Parameter storages are not activations and are
skipped. Inside a recomputed region
`torch.utils.checkpoint` installs its own hook, so only what it really keeps (the region's
inputs) is seen, which is the point.

The formulas these are compared with live in planner/activations.py (activations) and
planner/parameters.py (`zero_formula_bytes`).
"""
from __future__ import annotations

import contextlib
import resource
import weakref

import torch

import parallel_state as ps

from data_parallel.ddp import STRATEGIES  # ZeRO stages 0-3, in order
from data_parallel.distributed_optimizer import DistributedOptimizer
from layers.quantized import quantized_weights
from layers.recompute import recompute_spans
from planner.activations import model_chunk_bytes, paper_layer_bytes
from planner.parameters import zero_formula_bytes


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
        self.holders: dict[int, list] = {}  # weak references to the tensors saved on each
        self.held: set[int] = set()  # the storages still saved when the context closed
        self.region = "other"
        self._handles = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _param_storages(self) -> set[int]:
        return {p.untyped_storage().data_ptr() for p in self.param_list}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr in self.storages and not self._alive(ptr):
            del self.storages[ptr]  # freed since (its graph was dropped): a new storage here
        if ptr and ptr not in self.storages and ptr not in self.params:
            self.params = self._param_storages()  # ZeRO-3 re-allocates gathered parameters
        if ptr and ptr not in self.params:
            if ptr not in self.storages:
                self.storages[ptr] = (storage.nbytes(), self.region)
                self.holders[ptr] = []
            self.holders[ptr].append(weakref.ref(t))
        return t

    def _alive(self, ptr: int) -> bool:
        """Whether a graph still holds a tensor saved on storage `ptr` (a region that saves
        its inputs but whose output needs no gradient, e.g. a checkpoint in a LoRA model's
        first layer, drops them at once)."""
        return any(ref() is not None for ref in self.holders[ptr])

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
        self.held = {ptr for ptr in self.storages if self._alive(ptr)}
        for h in self._handles:
            h.remove()
        self._handles = []

    def bytes(self, region: str | None = None) -> int:
        """Bytes of the saved storages (of `region`) that a graph held when the context
        closed."""
        return sum(n for ptr, (n, r) in self.storages.items()
                   if (region is None or r == region) and ptr in self.held)


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
    Returns `{"total", "layers", "pre_process", "num_layers", "layer_numbers"}` (bytes,
    bytes in decoder layers, whether the first chunk holds the embedding, layers, their
    global numbers).
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
            "pre_process": bool(modules[0].pre_process),
            "num_layers": sum(len(m.decoder.layers) for m in modules),
            "layer_numbers": [int(n) for m in modules for n in m.decoder.layers]}


def activation_report(config, measured: dict, *, micro_batch_size: int, tp: int, sp: bool,
                      granularity, method, recompute_num_layers, dtype=torch.float32,
                      dropout: bool | None = None, keyed_dropout: bool = True,
                      cp: int = 1, lora=None) -> dict:
    """Record of measured vs predicted activation bytes per microbatch on this rank (`cp`:
    the context-parallel size; a rank holds `s / cp` tokens of each sequence; `lora`: a
    LoRA run's `planner.activations.FrozenBase`)."""
    s, b, n = config.seq_length // cp, micro_batch_size, measured["num_layers"]
    e = torch.tensor([], dtype=dtype).element_size()
    model = model_chunk_bytes(config, n, s, b, tp, sp, granularity, method, recompute_num_layers,
                              e, dropout, keyed_dropout, measured.get("layer_numbers"),
                              ep=ps.get_expert_model_parallel_world_size(),
                              context_parallel=cp > 1, lora=lora,
                              frozen_input=lora is not None and measured.get("pre_process",
                                                                             False))
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
    buffer of ZeRO-1/2 or the parameter shards of ZeRO-3), `frozen_params` (parameters that
    do not train: a LoRA run's base, whole on every rank of its TP/PP shard),
    `frozen_low_bit` (the storage of the base's low-bit weights under QLoRA, which are not
    parameters: layers/quantized.py), `grads` (the float32 gradient
    buffer, or the gradient shards of ZeRO-2/3), `main_params` (float32 copies separate from
    the weights), `optimizer_states` (AdamW moments), their sum `total`, and in host memory
    (--optimizer-cpu-offload) `host_main_params`, `host_optimizer_states`, `host_grads` and
    `host_total` (with --optimizer-offload-device nvme the streaming buffers
    `host_swap_buffers`), on NVMe `nvme_main_params`, `nvme_optimizer_states` and
    `nvme_total` (the scratch file's bytes; `predicted_nvme_total` is 12 B x the offloaded
    elements, ZeRO-Infinity's fp32 main copy and two moments). Padding to multiples of dp is
    included: it is allocated.

    Formulas: `predicted_total` / `predicted_host_total` = `zero_formula_bytes` with the padded
    parameter count (must equal the measurement exactly); `paper_total` with the unpadded one
    (the paper's, e.g. `(W + G + K) psi / N_d` for stage 3). Expert-parallel weights, sharded
    over the expert-data-parallel group, count with N_d = edp: the formula is summed over the
    wrappers' bucket groups (`dp` and `edp` report both sizes). Under ZeRO-3 also
    `gathered_params_predicted_peak` (data_parallel/fsdp.py).

    `model`: the DistributedDataParallel wrappers of this rank's chunks; `optimizer`: a
    `DistributedOptimizer`, or a torch AdamW (no_shard in float32) whose lazily created moments
    are counted as AdamW will allocate them.
    """
    def size(t):
        return 0 if t is None else t.numel() * t.element_size()

    params = [p for d in model for p in d.params]
    out = {"params": sum(size(d.param_shards) if d.param_shards is not None else
                         size(d.param_buffer) if d.param_buffer is not None else
                         0 if d.param_file is not None else
                         sum(size(p) for p in d.params)
                         for d in model if d.param_offload is None),
           "host_params": sum(size(d.param_shards) for d in model if d.param_offload == "cpu"),
           "nvme_params": sum(d.param_file.nbytes for d in model if d.param_file is not None),
           "grads": sum(size(d.grad_shards) if d.shard_grads else size(d.buffer.data)
                        for d in model),
           # a LoRA run's frozen base (no gradients, no optimizer state; not in `total`,
           # whose ZeRO formula counts the trained parameters)
           "frozen_params": sum(size(p) for p in {id(p): p for d in model
                                                  for p in d.module.parameters()
                                                  if not p.requires_grad}.values()),
           "frozen_low_bit": sum(w.nbytes for w in {id(w): w for d in model
                                                    for _, w in quantized_weights(d.module)
                                                    }.values())}
    if isinstance(optimizer, DistributedOptimizer):
        out.update(optimizer.state_bytes())
        n_host = sum(s.hi - s.lo for s in optimizer.shards if s.host)
        n_nvme = [s.hi - s.lo for s in optimizer.shards if s.nvme]
        buffers = optimizer.buffer_count * 16 * max(n_nvme, default=0)
    else:
        out.update(main_params=0, optimizer_states=2 * sum(size(p) for p in params),
                   host_main_params=0, host_optimizer_states=0, host_grads=0,
                   host_swap_buffers=0, nvme_main_params=0, nvme_optimizer_states=0)
        n_host, n_nvme, buffers = 0, [], 0
    out["total"] = out["params"] + out["grads"] + out["main_params"] + out["optimizer_states"]
    out["host_total"] = out["host_main_params"] + out["host_optimizer_states"] + \
        out["host_grads"] + out["host_swap_buffers"] + out["host_params"]
    out["nvme_total"] = out["nvme_main_params"] + out["nvme_optimizer_states"] + \
        out["nvme_params"]
    strategy = model[0].strategy if model else "no_shard"
    dp = model[0].dp_size if model else 1
    weight = params[0].element_size() if params else 4
    # a separate fp32 main copy: bf16 weights, or mixed precision without a parameter store
    main_copy = weight != 4 or (strategy == "no_shard" and isinstance(optimizer,
                                                                     DistributedOptimizer))
    # parameter offload: the main weights cannot be the (off-device) parameter shards
    main_copy = main_copy or any(d.param_file is not None or (
        d.param_offload == "cpu" and d.device.type != "cpu") for d in model)
    psi, padded = {}, {}  # elements by the size of the group their bucket reduces over
    for d in model:
        for b in d.buffer.buckets:
            n = b.comm.size
            psi[n] = psi.get(n, 0) + sum(p.numel() for p in b.params)
            padded[n] = padded.get(n, 0) + b.end - b.start

    def formula(counts: dict, host: int = 0, nvme: int = 0, **kw) -> tuple[int, int]:
        sums = [zero_formula_bytes(c, dp=n, host_elements=host if i == 0 else 0,
                                   nvme_elements=nvme if i == 0 else 0, **kw)
                for i, (n, c) in enumerate(sorted(counts.items()))]  # linear in the host part
        return sum(x for x, _ in sums), sum(y for _, y in sums)

    kw = dict(strategy=strategy, weight_bytes=weight, main_copy=main_copy)
    out["predicted_total"], out["predicted_host_total"] = formula(padded, n_host, sum(n_nvme),
                                                                  **kw)
    out["predicted_host_total"] += buffers
    out["predicted_nvme_total"] = 12 * sum(n_nvme)
    offloaded = weight * sum(c // n for n, c in padded.items())  # ZeRO-3's W psi / N_d
    where = {d.param_offload for d in model} - {None}
    if where:  # parameter offload moves the weight shards off the device
        out["predicted_total"] -= offloaded
        out["predicted_host_total" if where == {"cpu"} else "predicted_nvme_total"] += offloaded
    out["paper_total"] = formula(psi, n_host, sum(n_nvme), **kw)[0] - \
        (weight * sum(c // n for n, c in psi.items()) if where else 0)
    out.update(psi=sum(psi.values()), psi_padded=sum(padded.values()), dp=dp,
               edp=model[0].expert_comm.size if model else 1, strategy=strategy)
    for name in STRATEGIES:  # what each strategy would hold for this rank's parameters
        out[f"paper_total_{name}"] = formula(
            psi, strategy=name, weight_bytes=weight,
            main_copy=weight != 4 or (name == "no_shard" and main_copy))[0]
    if model and model[0].units is not None:
        out["gathered_params_predicted_peak"] = sum(d.units.predicted_peak_bytes() for d in model)
    return out
