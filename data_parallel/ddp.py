"""Data parallelism: contiguous gradient buffers, bucketed reduction overlapped with backward,
and the four sharding strategies of Megatron-FSDP (`--data-parallel-sharding-strategy`).

Every trainable parameter has a place in one flat index space, split into buckets of about
`bucket_size` elements in reverse registration order (roughly the order backward produces
gradients). A bucket's collective over the data-parallel group starts as soon as the last of
its gradients is accumulated (a post-accumulate-grad hook), so communication overlaps the rest
of backward (as PyTorch DDP, Li et al. 2020, sec. 3.2.3, and Megatron's --overlap-grad-reduce).

Strategies (ZeRO stages, Rajbhandari et al. 2020, sec. 5; memory per rank for psi parameters,
N_d data-parallel ranks, W/G bytes per weight/gradient, K optimizer bytes per parameter):

- `no_shard` (stage 0): one float32 gradient buffer, all-reduced on the last microbatch of a
  step; every rank updates every parameter. `(W + G + K) psi`.
- `optim` (stage 1, `--use-distributed-optimizer`): each bucket is padded to a multiple of dp
  and split into dp equal contiguous shards; the gradient buffer is reduce-scattered, rank r
  keeps main weights and moments of shard r only (`shard_range`) and updates them; parameters
  live in one contiguous buffer of the same layout (`param_buffer`) that `start_param_sync`
  all-gathers bucket by bucket while the next forward starts (a forward pre-hook per module
  waits for its buckets). `(W + G) psi + K psi / N_d`.
- `optim_grads` (stage 2): as `optim`, but no persistent full gradient buffer: each bucket's
  gradient is accumulated into a temporary float32 buffer during each microbatch's backward,
  reduce-scattered as soon as it is complete and added into this rank's persistent gradient
  shard (`grad_shards`), after which the temporary buffer is freed (at most two buckets in
  flight, as Megatron-FSDP's sliding drain). `W psi + (G + K) psi / N_d`.
- `optim_grads_params` (stage 3, FSDP): as `optim_grads`, and between uses each rank keeps
  only its shard of the parameters (`param_shards`); `data_parallel.fsdp.ParameterUnits`
  all-gathers them per unit (a transformer layer, the embedding, the output layer) just
  before its forward and again before its backward, frees them right after, and prefetches the
  next unit's gather so it overlaps compute. `(W + G + K) psi / N_d` plus the gathered units.
  With `param_offload_device` (ZeRO-Infinity's parameter offload, Rajbhandari et al. 2021,
  sec. 5.1) the `W psi / N_d` shards live off the device between uses: in host memory ("cpu":
  `param_shards` is a host tensor, pinned on CUDA, copied in per unit for its all-gather) or
  in a raw file in this process's scratch folder ("nvme": `param_file`; no `param_shards`;
  fsdp.py reads a unit's shard into a host buffer one unit ahead of its all-gather). Use
  `read_params` / `write_params` to reach the shards wherever they live.

With sharding, the tied embedding's copy on the first or last pipeline stage gets a bucket of
its own, so both copies are sharded identically and their gradient all-reduce (across stages)
can run on the reduced shard (as Megatron-core does). Buckets of TP ranks have the same layout
(their local shapes are equal), so sequence-parallel norm gradients can be summed over TP on
shards as well (`grad_pieces`).

Mixed precision (Megatron's accumulate_allreduce_grads_in_fp32): with a full buffer, float32
parameters use `main_grad` as their `.grad` (autograd accumulates in place) and bf16/fp16
parameters get their `.grad` added into the float32 `main_grad` by the hook, which frees
`.grad`; with sharded gradients every `.grad` is added into the temporary float32 bucket and
freed.

Gradients are SUMMED over data-parallel ranks: the training loss is already divided by the
number of tokens of the whole global batch, so the sum is the exact global mean.

Expert parallelism (mixture of experts, as Megatron-Core's separate expert buffers): a routed
expert's weight (tagged `expert_parallel`) holds this rank's block of the layer's experts,
which only the expert-data-parallel (edp) ranks share, so with `expert_data_parallel_group`
the expert parameters get buckets of their own, reduced over that group, while the others
reduce over the data-parallel group. Every strategy shards each set over its own group: an
expert bucket is padded to a multiple of edp and split into edp shards. A bucket records its
group (`_Comm`) and where its shard sits in `grad_shards` / `param_shards` (`shard_start`),
so one flat index space holds both sets. When the two groups are the same (ep 1) nothing is
split.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from parallel_state import collectives, weight_grads
from parallel_state.collectives import all_gather_single, reduce_scatter_single

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
_MAX_REDUCTIONS_IN_FLIGHT = 2  # sharded gradients: temporary full buckets alive at once


@dataclass(frozen=True)
class _Comm:
    """The group a bucket reduces over (dense: data-parallel; experts: expert-data-parallel),
    its size and this rank's place in it."""

    group: object
    size: int
    rank: int
    expert: bool = False

    @staticmethod
    def of(group, expert: bool = False) -> "_Comm":
        if not dist.is_initialized():
            return _Comm(group, 1, 0, expert)
        return _Comm(group, dist.get_world_size(group), dist.get_rank(group), expert)


@dataclass
class _Bucket:
    start: int
    end: int  # padded end (end - start is a multiple of comm.size when sharding)
    params: list[nn.Parameter]
    comm: _Comm
    shard_start: int = 0  # sharding: first element of its shard in grad_shards / param_shards
    ready: int = 0
    handle: object | None = None  # in-flight gradient all-reduce / reduce-scatter
    gather: object | None = None  # in-flight parameter all-gather (optim, optim_grads)
    grad_full: torch.Tensor | None = None  # sharded grads: gradient being accumulated
    unit: object | None = None  # optim_grads_params: the data_parallel.fsdp unit holding it


@dataclass
class GradBuffer:
    """The float32 gradient buffer (None when gradients are sharded) and its buckets."""

    data: torch.Tensor | None
    buckets: list[_Bucket] = field(default_factory=list)


def resolve_strategy(strategy: str | None, use_distributed_optimizer: bool) -> str:
    """The sharding strategy; `--use-distributed-optimizer` is the alias of `optim`.

    Raises:
        ValueError: an unknown strategy, or `no_shard` together with the alias.
    """
    if strategy is None:
        return "optim" if use_distributed_optimizer else "no_shard"
    if strategy not in STRATEGIES:
        raise ValueError(f"--data-parallel-sharding-strategy must be one of {list(STRATEGIES)}, "
                         f"got {strategy!r}")
    if strategy == "no_shard" and use_distributed_optimizer:
        raise ValueError("--use-distributed-optimizer shards the optimizer, which contradicts "
                         "--data-parallel-sharding-strategy no_shard; drop one of them")
    return strategy


class DistributedDataParallel(nn.Module):
    """Wrap `module`; `forward` is the module's. Call, per training step:

    ```
    ddp.zero_grad_buffer()
    for i, mb in enumerate(microbatches):
        ddp.sync_enabled = i == last   # no_shard/optim: buckets reduce in the last backward
        loss(mb).backward()            # optim_grads(_params): every backward reduce-scatters
    ddp.finish_grad_sync()   # waits for (and launches any leftover) bucket reductions
    ```

    Args:
        overlap_grad_reduce: no_shard/optim: launch each bucket's reduction during the last
            backward (else all in `finish_grad_sync`); sharded gradients are always
            reduce-scattered as soon as a bucket is complete.
        data_parallel_sharding_strategy: one of `STRATEGIES` (see the module docstring);
            None: `optim` if `use_distributed_optimizer`, else `no_shard`.
        fsdp_unit_modules: `optim_grads_params` only: the submodules gathered as one unit, in
            forward order (default: `module.sharding_units()` when it has that method, else
            none); parameters outside them form the root unit, gathered for a whole
            forward-backward.
        expert_data_parallel_group: the group the `expert_parallel` parameters reduce over
            (module docstring); None or the data-parallel group: they are dense ones.
        param_offload_device: `optim_grads_params` only: None (on the device), "cpu" or
            "nvme" (a file in a scratch folder of this process under `offload_path`, named
            for global `rank`, served by `io_threads` threads); see the module docstring.
        param_init: `optim_grads_params` only: `param_init(name, param)` gives the values
            (this rank's TP shard, shaped and typed as `param`) of each parameter on the meta
            device (a model built in `layers.sharding.parameters_on_meta()`), made one unit at
            a time so no rank holds the whole model (`name` as in `module.named_parameters()`;
            e.g. `layers.sharding.initial_value`).
        device: where meta-device parameters go (default: the parameters' device).
    Attributes:
        offsets: `{id(param): start}` of each parameter in the flat index space.
        numel_padded: size of the flat index space (all buckets, padding included).
    Raises:
        TypeError: parameters of several dtypes.
        ValueError: a bad strategy (see `resolve_strategy`); meta-device parameters without
            `optim_grads_params`, `param_init` and `device`.
    """

    def __init__(self, module: nn.Module, *, data_parallel_group=None,
                 bucket_size: int = 40_000_000, overlap_grad_reduce: bool = True,
                 use_distributed_optimizer: bool = False,
                 data_parallel_sharding_strategy: str | None = None,
                 fsdp_unit_modules: list[nn.Module] | None = None,
                 expert_data_parallel_group=None, param_offload_device: str | None = None,
                 offload_path: str | None = None, rank: int = 0, io_threads: int = 2,
                 pin_memory: bool = True, param_init=None, device=None):
        super().__init__()
        self.module = module
        self.group = data_parallel_group
        dense = _Comm.of(data_parallel_group)
        self.dp_size, self.dp_rank = dense.size, dense.rank
        split = expert_data_parallel_group not in (None, data_parallel_group)
        if not split and _experts_split_over_ranks(module):
            raise ValueError("expert-parallel parameters (ep > 1) must reduce over the expert-"
                             "data-parallel group, not the data-parallel one: pass "
                             "expert_data_parallel_group=get_expert_data_parallel_group()")
        self.expert_comm = _Comm.of(expert_data_parallel_group, expert=True) if split else dense
        self.strategy = resolve_strategy(data_parallel_sharding_strategy,
                                         use_distributed_optimizer)
        self.use_distributed_optimizer = self.strategy != "no_shard"
        self.shard_grads = self.strategy in ("optim_grads", "optim_grads_params")
        self.shard_params = self.strategy == "optim_grads_params"
        self.overlap_grad_reduce = overlap_grad_reduce and \
            max(self.dp_size, self.expert_comm.size) > 1
        self.sync_enabled = True
        params = [p for p in module.parameters() if p.requires_grad]
        if len({p.dtype for p in params}) > 1:
            raise TypeError(f"parameters of one model chunk must share a dtype, got "
                            f"{sorted({str(p.dtype) for p in params})}")
        self.params = params
        self.param_dtype = params[0].dtype if params else torch.float32
        self.device = torch.device(device) if device is not None else \
            params[0].device if params else torch.device("cpu")
        meta = [n for n, p in module.named_parameters() if p.is_meta]
        if meta and (self.strategy != "optim_grads_params" or param_init is None or
                     self.device.type == "meta" or
                     any(p.is_meta and not p.requires_grad for p in module.parameters())):
            raise ValueError(f"parameters on the meta device ({meta[0]} ...) are materialized "
                             f"only by ZeRO-3: pass data_parallel_sharding_strategy="
                             f"'optim_grads_params', param_init and device (got "
                             f"{self.strategy!r}, param_init {param_init}, device "
                             f"{self.device}; every meta parameter trainable), or build the model with "
                             f"real parameters")
        self.param_init = param_init
        self.units = None
        if self.shard_params:
            from .fsdp import ParameterUnits

            if fsdp_unit_modules is None:
                get = getattr(module, "sharding_units", None)
                fsdp_unit_modules = get() if get is not None else []
            self.units = ParameterUnits(self, fsdp_unit_modules)
            groups = self.units.param_groups()
        else:
            groups = [params]
        sets = [(g, dense) for g in groups] if not split else \
            [(s, c) for g in groups for s, c in (
                ([p for p in g if not getattr(p, "expert_parallel", False)], dense),
                ([p for p in g if getattr(p, "expert_parallel", False)], self.expert_comm))]
        buckets, self.offsets = self._layout_sets(sets, bucket_size,
                                                  self.use_distributed_optimizer)
        self.numel_padded = buckets[-1].end if buckets else 0
        self._bucket_of = {id(p): b for b in buckets for p in b.params}
        total = self.numel_padded
        shard_total = buckets[-1].shard_start + self._shard_size(buckets[-1]) if buckets else 0
        self.buffer = GradBuffer(None if self.shard_grads else torch.zeros(
            total, dtype=torch.float32, device=self.device), buckets)
        self.grad_shards = torch.zeros(shard_total, dtype=torch.float32, device=self.device) \
            if self.shard_grads else None
        self._reductions: list[tuple] = []  # sharded grads: (bucket, buffer, work) in flight
        self._callback_queued = False
        self.param_buffer = self.param_shards = self.param_file = None
        self.param_offload = param_offload_device if self.shard_params else None
        self.pin_offload = pin_memory  # page-locked host buffers for offloaded shards (CUDA)
        if self.param_offload not in (None, "cpu", "nvme"):
            raise ValueError(f"param_offload_device must be None, 'cpu' or 'nvme', got "
                             f"{param_offload_device!r}")
        if self.param_offload == "nvme":
            self._open_param_file(offload_path, rank, shard_total, io_threads)
        elif self.shard_params:
            pin = self.param_offload == "cpu" and pin_memory and self.device.type == "cuda"
            self.param_shards = torch.zeros(
                shard_total, dtype=self.param_dtype, pin_memory=pin,
                device="cpu" if self.param_offload == "cpu" else self.device)
        if self.shard_params:
            self.units.build(buckets)  # params become views of per-unit gathered buffers
        elif self.use_distributed_optimizer and params:
            self.param_buffer = torch.zeros(total, dtype=self.param_dtype, device=self.device)
            with torch.no_grad():
                for p in params:
                    view = self._view(self.param_buffer, p)
                    view.copy_(p)
                    p.data = view
        for p in params:
            p.main_grad = None if self.shard_grads else self._view(self.buffer.data, p)
            p.grad = p.main_grad if p.dtype == torch.float32 else None
            p.register_post_accumulate_grad_hook(_weak_hook(self))
        if self.param_buffer is not None and any(b.comm.size > 1 for b in buckets):
            for m in module.modules():
                own = [p for p in m._parameters.values() if p is not None and id(p) in self.offsets]
                if own:
                    m.register_forward_pre_hook(self._make_param_wait(own))

    @staticmethod
    def _layout(groups, bucket_size: int, pad: int):
        """`_layout_sets` of one set, `groups` (lists of parameters), padded to multiples of
        `pad` (the planner's view: planner/parameters.py `chunk_layout`)."""
        comm = _Comm(None, pad, 0)
        return DistributedDataParallel._layout_sets([(g, comm) for g in groups], bucket_size,
                                                    shard=True)

    @staticmethod
    def _layout_sets(sets, bucket_size: int, shard: bool):
        """Buckets over `sets` (`(parameters, _Comm)` pairs; a bucket never spans two sets),
        each in reverse registration order; a shared (tied) embedding alone in its own bucket
        when sharding; each bucket padded to a multiple of its group's size when sharding
        (`shard`), its shard placed after the previous bucket's."""
        buckets, offsets, offset, start, current, shards = [], {}, 0, 0, [], 0

        def close():
            nonlocal offset, start, current, shards
            if current:
                pad = comm.size if shard else 1
                offset = start + -(-(offset - start) // pad) * pad
                buckets.append(_Bucket(start, offset, current, comm, shards))
                shards += (offset - start) // pad
            start, current = offset, []

        for params, comm in sets:
            for p in reversed(params):
                alone = shard and comm.size > 1 and (
                    getattr(p, "shared_embedding", False) or
                    getattr(p, "stage_group", None) is not None)
                if alone:
                    close()
                offsets[id(p)] = offset
                offset += p.numel()
                current.append(p)
                if alone or offset - start >= bucket_size:
                    close()
            close()
        return buckets, offsets

    def _view(self, flat: torch.Tensor, p: nn.Parameter, base: int = 0) -> torch.Tensor:
        start = self.offsets[id(p)] - base
        return flat[start: start + p.numel()].view_as(p)

    def _shard_size(self, bucket: _Bucket) -> int:
        return (bucket.end - bucket.start) // (bucket.comm.size if self.use_distributed_optimizer
                                               else 1)

    def shard_range(self, bucket: _Bucket) -> tuple[int, int]:
        """[lo, hi) of the flat index space this rank owns in `bucket` (its shard over the
        bucket's group; all of it unless sharding)."""
        if not self.use_distributed_optimizer:
            return bucket.start, bucket.end
        size = self._shard_size(bucket)
        lo = bucket.start + bucket.comm.rank * size
        return lo, lo + size

    @staticmethod
    def bucket_group(bucket: _Bucket):
        """The process group `bucket` is reduced (and, sharded, gathered) over."""
        return bucket.comm.group

    def _shard_pos(self, bucket: _Bucket, index: int) -> int:
        """Position of flat `index` (owned by this rank) in `grad_shards` / `param_shards`."""
        return index - self.shard_range(bucket)[0] + bucket.shard_start

    def grad_view(self, bucket: _Bucket, lo: int, hi: int) -> torch.Tensor:
        """Float32 gradient of owned flat range [lo, hi) of `bucket` (DP-reduced after
        `finish_grad_sync`)."""
        if self.shard_grads:
            return self.grad_shards[self._shard_pos(bucket, lo): self._shard_pos(bucket, hi)]
        return self.buffer.data[lo:hi]

    def param_view(self, bucket: _Bucket, lo: int, hi: int) -> torch.Tensor | None:
        """Persistent weights of owned flat range [lo, hi) (model dtype), or None without a
        flat parameter store in memory (`no_shard`: the weights are the parameters
        themselves; NVMe parameter offload: use `read_params` / `write_params`)."""
        if self.param_shards is not None:
            return self.param_shards[self._shard_pos(bucket, lo): self._shard_pos(bucket, hi)]
        if self.param_buffer is not None:
            return self.param_buffer[lo:hi]
        return None

    def _open_param_file(self, path: str | None, rank: int, numel: int, threads: int) -> None:
        import weakref

        from .offload_files import SwapFile, make_scratch, remove_scratch

        if not path:
            raise ValueError("param_offload_device='nvme' needs an offload_path")
        self.param_scratch = make_scratch(path, rank)
        self._remove_param_scratch = weakref.finalize(self, remove_scratch, self.param_scratch)
        try:
            self.param_file = SwapFile(self.param_scratch, "params.bin",
                                       numel * self.param_dtype.itemsize, threads)
        except BaseException:
            self._remove_param_scratch()
            raise

    def close_offload(self) -> None:
        """Delete the NVMe parameter file and its scratch folder (no-op without them)."""
        if self.param_file is not None:
            self.param_file.close()
            self.param_file = None
            self._remove_param_scratch()

    def param_file_offset(self, bucket: _Bucket, lo: int) -> int:
        """Byte offset of owned flat index `lo` of `bucket` in `param_file`."""
        return self._shard_pos(bucket, lo) * self.param_dtype.itemsize

    def read_params(self, bucket: _Bucket, lo: int, hi: int) -> torch.Tensor | None:
        """Persistent weights of owned flat range [lo, hi) wherever they live: `param_view`,
        or a host copy read from the NVMe parameter file."""
        if self.param_file is None:
            return self.param_view(bucket, lo, hi)
        out = torch.empty(hi - lo, dtype=self.param_dtype)
        self.param_file.read(self.param_file_offset(bucket, lo), out).result()
        return out

    def write_params(self, bucket: _Bucket, lo: int, hi: int, src: torch.Tensor) -> None:
        """Set the persistent weights of owned flat range [lo, hi) to `src` (in place, or
        written to the NVMe parameter file)."""
        if self.param_file is None:
            self.param_view(bucket, lo, hi).copy_(src)
            return
        host = src.detach().to("cpu", self.param_dtype).contiguous()
        self.param_file.write(self.param_file_offset(bucket, lo), host).result()

    def owned_segments(self, bucket: _Bucket, lo: int, hi: int):
        """`(param, first element in param, first element in [lo, hi), count)` for every
        parameter of `bucket` overlapping flat range [lo, hi)."""
        out = []
        for p in bucket.params:
            start = self.offsets[id(p)]
            a, b = max(start, lo), min(start + p.numel(), hi)
            if a < b:
                out.append((p, a - start, a - lo, b - a))
        return out

    def forward(self, *args, **kwargs):
        if self.units is not None:
            return self.units.run_root(self.module, args, kwargs)
        return self.module(*args, **kwargs)

    # ------------------------------------------------------------------ hooks and sync
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if weight_grads.is_deferred(param):
            return  # a zero-bubble B deferred this gradient: its W calls again with it
        if self.shard_grads:
            self._accumulate_sharded(param)
            return
        if param.grad is not None and param.grad.data_ptr() != param.main_grad.data_ptr():
            # bf16/fp16 weights: accumulate in fp32 and free the low-precision grad (also
            # repairs a float32 .grad that autograd replaced instead of accumulating into)
            param.main_grad.add_(param.grad)
            param.grad = param.main_grad if param.dtype == torch.float32 else None
        if not (self.sync_enabled and self.overlap_grad_reduce):
            return
        bucket = self._bucket_of[id(param)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _accumulate_sharded(self, param: nn.Parameter) -> None:
        """optim_grads(_params): add `.grad` into the bucket's temporary float32 buffer; a
        complete bucket is reduce-scattered at once (every microbatch)."""
        if not self._callback_queued:  # leftover buckets when this backward ends
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        bucket = self._bucket_of[id(param)]
        if bucket.grad_full is None:
            bucket.grad_full = torch.zeros(bucket.end - bucket.start, dtype=torch.float32,
                                           device=self.device)
        if param.grad is not None:
            self._view(bucket.grad_full, param, bucket.start).add_(param.grad)
            param.grad = None
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._reduce_scatter(bucket)

    def _reduce_scatter(self, bucket: _Bucket) -> None:
        lo, hi = self.shard_range(bucket)
        full, bucket.grad_full, bucket.ready = bucket.grad_full, None, 0
        handle = None
        if bucket.comm.size > 1:
            handle = reduce_scatter_single(full[lo - bucket.start: hi - bucket.start], full,
                                           group=bucket.comm.group, async_op=True)
        self._reductions.append((bucket, full, handle))
        while len(self._reductions) > _MAX_REDUCTIONS_IN_FLIGHT:
            self._drain()
        if self.units is not None and not self._in_weight_pass():
            self.units.bucket_reduced(bucket)

    def _drain(self) -> None:
        """Wait for the oldest reduce-scatter in flight, add its result into this rank's
        gradient shard and free its temporary buffer."""
        bucket, full, handle = self._reductions.pop(0)
        if handle is not None:
            handle.wait()
        lo, hi = self.shard_range(bucket)
        self.grad_view(bucket, lo, hi).add_(full[lo - bucket.start: hi - bucket.start])

    def _end_of_backward(self) -> None:
        """Autograd callback at the end of a backward (sharded grads): buckets with some
        gradients but not all (unused parameters) are reduced now, so they do not mix with
        the next microbatch."""
        self._callback_queued = False
        for bucket in self.buffer.buckets:
            if bucket.grad_full is not None:
                self._reduce_scatter(bucket)
        if self.units is not None and not self._in_weight_pass():
            self.units.end_of_backward(split=weight_grads.splitting())

    @staticmethod
    def _in_weight_pass() -> bool:
        """A zero-bubble W runs: it reads no parameters, so ZeRO-3 units are not its business
        (B already released them)."""
        return weight_grads.splitting() and not weight_grads.collecting()

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.handle is not None or bucket.comm.size == 1:
            return
        data = self.buffer.data[bucket.start: bucket.end]
        if self.use_distributed_optimizer:
            lo, hi = self.shard_range(bucket)
            bucket.handle = reduce_scatter_single(self.buffer.data[lo:hi], data,
                                                  group=bucket.comm.group, async_op=True)
        else:
            bucket.handle = collectives.all_reduce(data, group=bucket.comm.group, async_op=True)

    def finish_grad_sync(self) -> None:
        """Launch reductions not yet launched and wait for all; grads are then DP-summed (only
        on `shard_range` when sharding; in `grad_shards` when gradients are sharded)."""
        if self.shard_grads:
            for bucket in self.buffer.buckets:
                if bucket.grad_full is not None:
                    self._reduce_scatter(bucket)
            while self._reductions:
                self._drain()
            return
        for bucket in self.buffer.buckets:
            self._launch(bucket)
        for bucket in self.buffer.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
            bucket.handle, bucket.ready = None, 0

    def zero_grad_buffer(self) -> None:
        """Zero all gradients (in place) and re-attach `.grad` views the optimizer may have dropped."""
        if self.shard_grads:
            self.grad_shards.zero_()
            for p in self.params:
                p.grad = None
        else:
            self.buffer.data.zero_()
            for p in self.params:
                if p.dtype != torch.float32:
                    p.grad = None
                elif p.grad is None or p.grad.data_ptr() != p.main_grad.data_ptr():
                    p.grad = p.main_grad
        for bucket in self.buffer.buckets:
            bucket.ready, bucket.handle, bucket.grad_full = 0, None, None
        self._reductions = []
        if self.units is not None:
            self.units.new_step()

    def grad_pieces(self, predicate) -> list[torch.Tensor]:
        """This rank's float32 gradient of every parameter satisfying `predicate`: the whole
        `main_grad`, or the owned pieces of it when gradients are sharded (in bucket order, so
        TP ranks and the two tied-embedding stages list matching pieces)."""
        if not self.shard_grads:
            return [p.main_grad for p in self.params if predicate(p)]
        out = []
        for bucket in self.buffer.buckets:
            lo, hi = self.shard_range(bucket)
            grads = self.grad_view(bucket, lo, hi)
            for p, _, at, n in self.owned_segments(bucket, lo, hi):
                if predicate(p):
                    out.append(grads[at: at + n])
        return out

    # ------------------------------------------------------------------ parameter all-gather
    def start_param_sync(self) -> None:
        """After each rank wrote its updated shard: all-gather every bucket of `param_buffer`
        over DP (async, in place; buckets in forward order, forward pre-hooks wait for the
        ones a module needs), or (optim_grads_params) drop the stale gathered units and
        prefetch the first."""
        if self.units is not None:
            self.units.invalidate(prefetch=True)
            return
        if self.param_buffer is None:
            return
        for bucket in reversed(self.buffer.buckets):
            if bucket.comm.size == 1:
                continue
            lo, hi = self.shard_range(bucket)
            bucket.gather = all_gather_single(self.param_buffer[bucket.start: bucket.end],
                                              self.param_buffer[lo:hi], group=bucket.comm.group,
                                              async_op=self.overlap_grad_reduce)

    def _make_param_wait(self, params):
        buckets = list({id(b): b for b in (self._bucket_of[id(p)] for p in params)}.values())

        def hook(module, args):
            for b in buckets:
                if b.gather is not None:
                    b.gather.wait()
                    b.gather = None
        return hook

    def finish_param_sync(self) -> None:
        """Make every parameter hold its full, current value for reading outside a forward:
        wait for in-flight all-gathers, or (optim_grads_params) gather every unit and keep it
        until the next optimizer step or forward frees it."""
        if self.units is not None:
            self.units.gather_all()
            return
        for bucket in self.buffer.buckets:
            if bucket.gather is not None:
                bucket.gather.wait()
                bucket.gather = None

    def release_params(self) -> None:
        """optim_grads_params: free every gathered copy (e.g. after `finish_param_sync` once
        the full weights have been read); no-op otherwise."""
        if self.units is not None:
            self.units.invalidate(prefetch=False)

    @torch.no_grad()
    def load_param_(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """Set `param` (this rank's TP shard) to `value`: in place, or into the owned part of
        the parameter shards under optim_grads_params (gathered copies are dropped)."""
        if not self.shard_params:
            param.copy_(value.to(param.device, param.dtype))
            return
        bucket = self._bucket_of[id(param)]
        lo, hi = self.shard_range(bucket)
        flat = value.reshape(-1)
        shard = self.read_params(bucket, lo, hi)
        for p, p_start, at, n in self.owned_segments(bucket, lo, hi):
            if p is param:
                shard[at: at + n].copy_(flat[p_start: p_start + n])
        if self.param_file is not None:
            self.write_params(bucket, lo, hi, shard)
        self.units.invalidate(prefetch=False)


def _experts_split_over_ranks(module: nn.Module) -> bool:
    """`module` holds routed-expert weights whose experts are split over ep > 1 ranks."""
    import parallel_state as ps

    return ps.get_expert_model_parallel_world_size() > 1 and \
        any(getattr(p, "expert_parallel", False) for p in module.parameters())


def _weak_hook(ddp: DistributedDataParallel):
    """The post-accumulate-grad hook of `ddp`, holding it weakly: a tensor hook is a reference
    from C++ that the garbage collector cannot see, so a strong one would keep every wrapper
    (and its buffers) alive forever."""
    ref = weakref.ref(ddp)

    def hook(param):
        owner = ref()
        if owner is not None:
            owner._on_grad_ready(param)
    return hook


def grad_pieces(model, predicate) -> list[torch.Tensor]:
    """`DistributedDataParallel.grad_pieces` over the wrappers of all model chunks."""
    return [g for ddp in model for g in ddp.grad_pieces(predicate)]


def all_reduce_embedding_grads(model) -> None:
    """Sum the gradients of the tied word embedding's copies (first and last pipeline stage;
    T5 also the first decoder stage) so all take the same update and stay equal (Megatron's
    embedding group), and likewise those of other parameters replicated over stages (the
    `stage_group` tag: T5's position-bias tables, over the stages of their stack). With
    sharding both copies sit alone in identically sharded buckets, so the sum is right on each
    rank's reduced (or kept) shard; the rest of a full buffer is not read.

    `model`: the DistributedDataParallel wrappers of this rank's chunks."""
    import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return
    grads = grad_pieces(model, lambda p: getattr(p, "shared_embedding", False))
    if len(grads) > 1:  # both copies on this rank (ZBV's V: stage 0): sum them here
        grads[0].add_(sum(grads[1:]))
        for g in grads[1:]:
            g.copy_(grads[0])
    group = ps.get_embedding_group()
    if group is not None and grads and dist.get_world_size(group) > 1:
        collectives.all_reduce(grads[0], group=group)
        for g in grads[1:]:
            g.copy_(grads[0])
    # other parameters replicated over stages (T5's per-stack position-bias tables)
    names = sorted({p.stage_group for ddp in model for p in ddp.params
                    if getattr(p, "stage_group", None) is not None})
    for name in names:
        group = ps.get_stage_group(name)
        if group is None:
            continue
        for g in grad_pieces(model, lambda p, name=name: getattr(p, "stage_group", None) == name):
            collectives.all_reduce(g, group=group)


def all_reduce_sequence_parallel_grad_pieces(model) -> None:
    """Sum over TP the gradients of the sequence-parallel (norm) weights of all chunks, on
    whatever piece of them this rank holds (see `parallel_state.mappings`)."""
    from parallel_state.mappings import all_reduce_over_tensor_parallel

    all_reduce_over_tensor_parallel(
        grad_pieces(model, lambda p: getattr(p, "sequence_parallel", False)))
