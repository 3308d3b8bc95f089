"""Sharded, layout-independent, atomic (and optionally asynchronous) checkpoints.

Every rank writes its own shards through `torch.distributed.checkpoint` (DCP); nothing is
gathered to rank 0. Keys do not depend on the parallel layout, so a checkpoint saved at one
(tp, pp, vpp, dp, distributed optimizer on/off) loads at any other:

- `model.<name>`: the float32 master value of each parameter (`name` uses global layer
  numbers), a DTensor on the TP sub-mesh with `Shard(partition_dim)` if TP-sharded, else a
  plain tensor (DCP keeps one copy of a key that several ranks hold). With --bf16 the
  optimizer's float32 main weights are saved, so nothing is lost to rounding.
- Fused weights (SwiGLU fc1 `[gate; up]`, `num_fused_parts > 1`) are saved as `.part0`,
  `.part1`: each is a clean `Shard(0)` of its own dense tensor.
- Vocab-padded tensors (`full_rows`: embedding, output layer) are saved at the saving layout's
  padded size; a layout with another padded size loads the dense tensor and re-pads it.
- The tied embedding's last-stage copy is not saved; it loads from the embedding.
- MoE expert weights (stacked `[E_local, ...]`, this EP rank's block of experts) are saved
  one key per global expert (`...mlp.experts.<e>.linear_fc1.weight`), TP-sharded like the
  dense MLP, so a checkpoint loads at any expert-parallel size; persistent buffers (the
  router's `expert_bias`) are saved as `model.<name>`, without moments (checkpoint/keys.py).
- `optim.exp_avg.<name>`, `optim.exp_avg_sq.<name>` (same keys/sharding as the parameter),
  `optim.step`, `iteration`, `consumed_samples` (the data position, summed per step). The LR
  schedule is a pure function of the iteration (training/optimizer.py `learning_rate`); its
  settings go to metadata.json (`opt_param_scheduler`) beside the data config (`data`) and
  `data_start_samples`, compared on resume (`reconcile_schedule`, `check_data_config`).
- `rng.rank<R>.*`: each rank's torch (and CUDA) generator and TP-tracker states. They are
  restored only on the same layout (exact resume); on another layout the fresh seeds stay.

ZeRO (`--data-parallel-sharding-strategy optim | optim_grads | optim_grads_params`, and
`--optimizer-offload-device cpu | nvme`): DP rank r owns a flat range of each bucket's main
weights and moments (on the device, in host memory, or in its NVMe scratch file, read and
written through `DistributedOptimizer.shard_state`: the scratch file is never the only copy
a checkpoint needs). On save, every bucket's main weights and moments
are all-gathered over DP, so each rank briefly holds the unsharded optimizer state of its
TP x PP shard (12 bytes per local parameter); on load every rank reads the per-parameter
tensors and copies out its own range (under ZeRO-3 also of the parameter shards). This is
what makes (any strategy) x (dp size) x (offload) resumable every way.

Atomicity: shards go to `<save>/iter_XXXXXXX.tmp-<random>/`; after every rank finished,
rank 0 writes metadata.json (files, sizes, sha256), verifies, renames the folder to
`iter_XXXXXXX` and replaces `latest_checkpointed_iteration.txt` (temp file + os.replace +
fsync). A crash at any point leaves the previous checkpoint and marker intact. `--keep-last N`
prunes older complete checkpoints only after that; `--save-replica DIR` copies a completed
checkpoint (temp name, then rename). Staging folders of saves that died are removed when a
run starts and when `--keep-last` prunes (`remove_debris`); a missing marker with `--load` =
`--save` resumes the newest verified checkpoint (`resume_path`).

Async (--async-save): the state is copied (to CPU) synchronously, then a background thread
writes and finalizes it over its own gloo process group, so its collectives never interleave
with training's. The next save and the end of training wait for it.

Test hooks (environment, for tests/test_checkpointing.py only):
`SHARDZOO_TEST_KILL_DURING_SAVE=R:K` SIGKILLs rank R after its shards of iteration K are
written and before the rename; `SHARDZOO_TEST_KILL_AT=R:K` SIGKILLs rank R after iteration K,
only on the first torchrun attempt (TORCHELASTIC_RESTART_COUNT 0);
`SHARDZOO_TEST_KILL_NODE_AT=R:K` likewise, after SIGKILLing rank R's torchrun agent (a lost
node; R may be `*`: every rank that has the variable; tests/test_elastic.py);
`SHARDZOO_TEST_HOLD_AT=W:K` blocks every rank after iteration K while the world has W ranks,
until its torchrun agent stops it (a node joined) or 120 s pass (then RuntimeError);
`SHARDZOO_TEST_SIGTERM_AT=R:K` sends SIGTERM to rank R inside step K (--exit-signal-handler).
"""
from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import signal
import threading

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import parallel_state as ps
from checkpoint.keys import (as_saved, buffer_entries, entries, load_buffers, read_plan, rebuild,
                             stored_pieces)
from checkpoint import safe_dcp
from checkpoint.model_io import (TOKENIZER_DIR, TOKENIZER_MODEL, model_tensors, read_tokenizer,
                                 verify_checkpoint, write_tokenizer)
from parallel_state import collectives
from parallel_state.collectives import all_gather_single

from checkpoint.files import FORMAT_VERSION
from checkpoint.format import (CONFIG, LATEST, METADATA, CheckpointError, compare_model,
                                describe_files, iter_dir_name, read_metadata, resolve_checkpoint,
                                verify_files)
from data_parallel.distributed_optimizer import DistributedOptimizer
from layers.quantized import refuse_quantized

from .diloco import load_state, save_state
from .elastic import elastic_notice, rejoin_warning
from checkpoint.lora_files import is_gguf

from .lora_checkpoint import load_base, load_gguf_base, lora_settings, refuse_lora_checkpoint
from .checkpoint_publish import prune, publish_folder, remove_debris, write_synced

KINDS = ("model", "optim.exp_avg", "optim.exp_avg_sq")


def _print0(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def _hook(var: str, iteration: int, first_attempt_only: bool = False,
          node: bool = False) -> None:
    """Test hook: SIGKILL this process (`node`: its torchrun agent first, the whole simulated
    node) if env `var` is "<this rank>:<iteration>" (for `node` also "*:<iteration>": any
    rank, for a variable set in one agent's environment only)."""
    spec = os.environ.get(var)
    if not spec or spec not in (f"{dist.get_rank()}:{iteration}",
                                f"*:{iteration}" if node else None):
        return
    if first_attempt_only and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if node:
        os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def kill_hook(iteration: int) -> None:
    """Test hook after each iteration (see module docstring: SHARDZOO_TEST_KILL_AT)."""
    _hook("SHARDZOO_TEST_KILL_AT", iteration, first_attempt_only=True)
    _hook("SHARDZOO_TEST_KILL_NODE_AT", iteration, first_attempt_only=True, node=True)
    if os.environ.get("SHARDZOO_TEST_HOLD_AT") == f"{dist.get_world_size()}:{iteration}":
        # a node's joining restarts the group (SIGTERM); default action: the process ends
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if not threading.Event().wait(120):
            raise RuntimeError("SHARDZOO_TEST_HOLD_AT: no node joined within 120 s")


def signal_hook(iteration: int) -> None:
    """Test hook inside step `iteration` (1-based): SIGTERM this process if env
    `SHARDZOO_TEST_SIGTERM_AT` is "<this rank>:<iteration>" (a preemption mid-step)."""
    if os.environ.get("SHARDZOO_TEST_SIGTERM_AT") == f"{dist.get_rank()}:{iteration}":
        os.kill(os.getpid(), signal.SIGTERM)


# ---------------------------------------------------------------------- optimizer values
def _flat_states(model, optimizer):
    """Per DDP wrapper, flat float32 [buffer numel] main weights and moments, assembled from
    the owned shards (all-gathered over DP when ZeRO-sharded)."""
    flats = {id(ddp): {k: torch.zeros(ddp.numel_padded, dtype=torch.float32, device=ddp.device)
                       for k in KINDS} for ddp in model}
    for s in optimizer.shards:
        f = flats[id(s.ddp)]
        with optimizer.shard_state(s) as tensors:  # NVMe: read from the scratch file
            for kind, src in zip(KINDS, tensors):
                f[kind][s.lo: s.hi].copy_(src)
    if optimizer.sharded and ps.get_data_parallel_world_size(with_context_parallel=True) > 1:
        for ddp in model:
            for bucket in ddp.buffer.buckets:
                lo, hi = ddp.shard_range(bucket)
                if hi - lo == bucket.end - bucket.start:  # a group of one (experts at edp 1)
                    continue
                for kind in KINDS:
                    flat = flats[id(ddp)][kind]
                    all_gather_single(flat[bucket.start: bucket.end], flat[lo:hi].clone(),
                                      group=ddp.bucket_group(bucket))  # dp, or edp: experts
    return flats


@torch.no_grad()
def _param_values(chunks, model, optimizer) -> tuple[dict, int]:
    """`({id(param): {kind: float32 TP-local tensor}}, step)`: master weights and moments."""
    out = {}
    if isinstance(optimizer, DistributedOptimizer):
        flats = _flat_states(model, optimizer)
        for ddp in model:
            for p in ddp.params:
                start = ddp.offsets[id(p)]
                out[id(p)] = {k: flats[id(ddp)][k][start: start + p.numel()].view_as(p)
                              for k in KINDS}
        return out, optimizer.step_count
    step = 0
    for _, p, _, _ in entries(chunks):
        st = optimizer.state.get(p, {})
        if "step" in st:
            step = int(st["step"])
        zeros = torch.zeros_like(p, dtype=torch.float32)
        out[id(p)] = {"model": p.detach().float(), "optim.exp_avg": st.get("exp_avg", zeros),
                      "optim.exp_avg_sq": st.get("exp_avg_sq", zeros)}
    return out, step


def _rng_state() -> dict[str, torch.Tensor]:
    r = dist.get_rank()
    out = {f"rng.rank{r}.torch": torch.get_rng_state()}
    for name, state in ps.get_rng_tracker().get_states().items():
        out[f"rng.rank{r}.tracker.{name}"] = state.cpu()
    if torch.cuda.is_available():
        out[f"rng.rank{r}.cuda"] = torch.cuda.get_rng_state()
    return out


def _set_rng_state(loaded: dict[str, torch.Tensor]) -> None:
    prefix = f"rng.rank{dist.get_rank()}."
    torch.set_rng_state(loaded[prefix + "torch"])
    tracker = {k[len(prefix + "tracker."):]: v for k, v in loaded.items()
               if k.startswith(prefix + "tracker.")}
    ps.get_rng_tracker().set_states(tracker)
    if prefix + "cuda" in loaded and torch.cuda.is_available():
        torch.cuda.set_rng_state(loaded[prefix + "cuda"])


def _describe_layout(layout: dict) -> str:
    """`tp=2 pp=1 vpp=None dp=2` (+ `cp=2` at context parallel, `ep=2` for an MoE model) of a
    `_layout` dict (a checkpoint's, or this run's)."""
    shown = ("tp", "pp", "vpp", "dp") + (("cp",) if layout.get("cp", 1) != 1 else ()) + \
        (("ep",) if "ep" in layout else ())
    return " ".join(f"{k}={layout.get(k)}" for k in shown)


def _layout(config) -> dict:
    """The layout metadata.json records; an MoE model's adds the grid's expert-model- and
    expert-tensor-parallel sizes (`ep`, `etp`)."""
    t = config.train
    layout = {"tp": t.tensor_model_parallel_size, "pp": t.pipeline_model_parallel_size,
              "vpp": t.virtual_pipeline_model_parallel_size, "dp": config.data_parallel_size,
              "cp": t.context_parallel_size, "world_size": config.world_size,
              "distributed_optimizer": t.use_distributed_optimizer,
              "data_parallel_sharding_strategy": t.data_parallel_sharding_strategy,
              "optimizer_cpu_offload": t.optimizer_cpu_offload, "bf16": t.bf16,
              "micro_batch_size": t.micro_batch_size}
    if config.model.num_moe_experts:
        layout.update(ep=ps.get_expert_model_parallel_world_size(),
                      etp=ps.get_expert_tensor_parallel_world_size())
    return layout


def state_to_save(config, chunks, model, optimizer, iteration: int, copy: bool,
                  consumed_samples: int | None = None, diloco=None) -> dict:
    """The flat DCP state dict of this rank (collective over DP when ZeRO-sharded, and under
    DiLoCo: training/diloco.py `save_state`). `consumed_samples`: samples trained on so far
    (default iteration x global batch)."""
    values, step = _param_values(chunks, model, optimizer)
    sd = save_state(diloco, chunks, values) if diloco is not None else {}
    for name, p, _, tied_copy in entries(chunks):
        if tied_copy:
            continue
        for kind in KINDS:
            for key, part in stored_pieces(kind, name, p, values[id(p)][kind]):
                sd[key] = as_saved(part.detach().clone() if copy else part.detach(), p)
    for name, b in buffer_entries(chunks):  # model state without moments (expert_bias)
        sd[f"model.{name}"] = b.detach().to(torch.float32, copy=copy)
    if consumed_samples is None:
        consumed_samples = iteration * config.train.global_batch_size
    sd.update({"iteration": torch.tensor(iteration), "consumed_samples":
               torch.tensor(consumed_samples), "optim.step": torch.tensor(step)})
    sd.update(_rng_state())
    return sd


@dataclasses.dataclass
class DataPosition:
    """Where training stands in the data: `consumed_samples` trained on since iteration 0
    (Megatron's counter, exact across --global-batch-size changes), of which the first
    `data_start_samples` came from an earlier data config (--override-data-config), so the
    next sample read is `consumed_samples - data_start_samples` of the current data."""

    consumed_samples: int = 0
    data_start_samples: int = 0

    @property
    def data_index(self) -> int:
        return self.consumed_samples - self.data_start_samples


@dataclasses.dataclass
class ResumeState:
    """What `load_checkpoint` hands the training loop: the iteration to start from, the data
    position, the checkpoint's metadata.json (None when nothing was resumed), and a LoRA
    run's base identity (its checkpoints record it)."""

    iteration: int = 0
    position: DataPosition = dataclasses.field(default_factory=DataPosition)
    meta: dict | None = None
    lora_base: dict | None = None  # a LoRA run's base identity (training/lora_checkpoint.py)


SCHEDULE_FIELDS = ("lr", "min_lr", "lr_warmup_iters", "lr_decay_iters", "lr_decay_style")


def lr_schedule(t) -> dict:
    """The LR schedule's settings (metadata.json `opt_param_scheduler`)."""
    return {k: getattr(t, k) for k in SCHEDULE_FIELDS}


def data_config(config) -> dict:
    """What decides the sample sequence (metadata.json `data`): a resume onto other values
    would read other samples at the same position."""
    t = config.train
    path = None
    if t.data_path:  # prefixes absolute, weights as given
        path = [x if i % 2 == 0 and len(t.data_path) > 1 else os.path.abspath(x)
                for i, x in enumerate(t.data_path)]
    return {"data_path": path, "split": t.split, "seed": t.seed,
            "seq_length": config.model.seq_length}


# ---------------------------------------------------------------------- save
class Checkpointer:
    """Saves (sync or async) and finalizes checkpoints; build it on every rank (collective:
    with --async-save it creates a gloo group for the background writer)."""

    def __init__(self, config, tokenizer: str | None = None, diloco=None):
        self.config, self.diloco = config, diloco  # diloco: training/diloco.py's state
        # written into every checkpoint (export and --finetune use it); read now, because the
        # source may be a checkpoint that --keep-last deletes later in this run
        self.tokenizer_files = read_tokenizer(tokenizer) if dist.get_rank() == 0 else {}
        t = config.train
        self.save_dir, self.async_save = t.save, t.async_save
        self.group = collectives.new_group(backend="gloo", label="checkpoint") if \
            self.async_save else None
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.last_saved: int | None = None
        self.lora_base: dict | None = None  # a LoRA run's base (training/lora_checkpoint.py)
        if dist.get_rank() == 0:  # no save of this job is live yet
            for root in (self.save_dir, t.save_replica):
                if root:
                    remove_debris(root, "at start-up")
        collectives.barrier()

    def save(self, iteration: int, chunks, model, optimizer, position: "DataPosition") -> None:
        """Write checkpoint `iteration` (completed steps) at data `position`; returns when
        written (sync) or when the state is copied (async). Raises `CheckpointError` from a
        previous async save, ValueError (one line) for a model holding low-bit weights
        (inference-only, layers/quantized.py), before anything is written."""
        for chunk in chunks:  # a LoRA run saves its float adapters (a QLoRA base is named)
            if not self.config.train.lora_rank:
                refuse_quantized(chunk, "saving a training checkpoint")
        self.wait()
        position = dataclasses.replace(position)  # the async writer keeps its own copy
        state = state_to_save(self.config, chunks, model, optimizer, iteration,
                              copy=self.async_save, consumed_samples=position.consumed_samples,
                              diloco=self.diloco)
        name = [secrets.token_hex(4) if dist.get_rank() == 0 else None]
        collectives.broadcast_object_list(name, src=0)
        tmp = os.path.join(self.save_dir, f"{iter_dir_name(iteration)}.tmp-{name[0]}")
        if dist.get_rank() == 0:
            os.makedirs(tmp)
            with open(os.path.join(tmp, CONFIG), "w") as f:
                f.write(self.config.to_yaml())
            write_tokenizer(self.tokenizer_files, tmp)
        collectives.barrier()
        self.last_saved = iteration
        if self.async_save:
            self.thread = threading.Thread(target=self._write,
                                           args=(state, tmp, iteration, position),
                                           name=f"checkpoint-{iteration}", daemon=True)
            self.thread.start()
        else:
            self._write(state, tmp, iteration, position)
            self.wait()

    def wait(self) -> None:
        """Wait for an in-flight async save; re-raise its error."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise err

    def _write(self, state: dict, tmp: str, iteration: int, position: "DataPosition") -> None:
        try:
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), process_group=self.group)
            _hook("SHARDZOO_TEST_KILL_DURING_SAVE", iteration)
            self._finalize(tmp, iteration, position)
        except BaseException as e:  # noqa: BLE001 - surfaced by wait() on the training thread
            self.error = e

    def _finalize(self, tmp: str, iteration: int, position: "DataPosition") -> None:
        g, rank = self.group, dist.get_rank()
        mine = [n for n in os.listdir(tmp) if n.startswith(f"__{rank}_")]
        if rank == 0:
            mine += [".metadata", CONFIG] + [
                os.path.relpath(os.path.join(d, f), tmp) for name in (TOKENIZER_DIR,)
                for d, _, fs in os.walk(os.path.join(tmp, name)) for f in fs]
            if os.path.exists(os.path.join(tmp, TOKENIZER_MODEL)):
                mine.append(TOKENIZER_MODEL)
        files = [None] * dist.get_world_size()
        collectives.all_gather_object(files, describe_files(tmp, mine), group=g)
        status = [None]
        if rank == 0:
            try:
                final = self._publish(tmp, iteration, [f for fs in files for f in fs], position)
                status = [f"saved checkpoint {final}"]
            except BaseException as e:  # noqa: BLE001 - every rank raises the same error
                status = [e if isinstance(e, CheckpointError) else
                          CheckpointError(f"saving {tmp} failed: {type(e).__name__}: {e}")]
        collectives.broadcast_object_list(status, src=0, group=g)
        if isinstance(status[0], BaseException):
            raise status[0]
        _print0(status[0])

    def _publish(self, tmp: str, iteration: int, files: list[dict],
                 position: "DataPosition") -> str:
        """Rank 0: metadata.json, verify, rename, `latest`, replica, pruning."""
        meta = {"format_version": FORMAT_VERSION, "iteration": iteration,
                "consumed_samples": position.consumed_samples,
                "data_start_samples": position.data_start_samples,
                "global_batch_size": self.config.train.global_batch_size,
                "opt_param_scheduler": lr_schedule(self.config.train),
                "data": data_config(self.config),
                "layout": _layout(self.config), "model": self.config.model.to_dict(),
                "torch_version": torch.__version__,
                "files": sorted(files, key=lambda f: f["name"])}
        if self.config.train.lora_rank:  # adapters only: the base is named, not stored
            meta["lora"] = dict(lora_settings(self.config.train), base=self.lora_base or {
                "path": None, "seed": self.config.train.seed})
        write_synced(os.path.join(tmp, METADATA), json.dumps(meta, indent=1))
        problems = verify_files(tmp, meta, checksums=False)
        if problems:
            raise CheckpointError(f"checkpoint {tmp} failed verification after writing; "
                                  f"the previous checkpoint stays current: " + "; ".join(problems))
        final = publish_folder(tmp, self.save_dir, iteration)
        if self.config.train.save_replica:
            replica = self.config.train.save_replica
            os.makedirs(replica, exist_ok=True)
            rtmp = os.path.join(replica, f"{iter_dir_name(iteration)}.tmp-{secrets.token_hex(4)}")
            shutil.copytree(final, rtmp)
            publish_folder(rtmp, replica, iteration)
            prune(replica, self.config.train.keep_last)
        prune(self.save_dir, self.config.train.keep_last)
        return final


# ---------------------------------------------------------------------- load
def _same(a: str | None, b: str | None) -> bool:
    return bool(a and b) and os.path.abspath(a) == os.path.abspath(b)


def resume_path(train_config) -> str | None:
    """The checkpoint `--load` resumes from (`resolve_checkpoint`); when --load is also
    --save and the marker is missing, the newest verified checkpoint there."""
    t = train_config
    return resolve_checkpoint(t.load, newest_if_no_marker=_same(t.load, t.save)) \
        if t.load else None


def completed_checkpoint(train_config) -> tuple[str, int] | None:
    """`(folder, iteration)` of the checkpoint that `--load` resumes from, read from its
    metadata.json without any process group (so a finished job can stop before any work);
    None when nothing is resumed: no --load, no checkpoint there yet, --finetune, a
    weights-only checkpoint, or the base of a LoRA run (all start at iteration 0). Raises `CheckpointError` for a bad
    marker or metadata, as `load_checkpoint` would."""
    t = train_config
    if not t.load or t.finetune or is_gguf(t.load):  # a GGUF file: a LoRA run's base
        return None
    path = resume_path(t)
    if path is None:
        return None
    meta = read_metadata(path, check=False)  # the iteration only; load_checkpoint checks
    if meta.get("optimizer_state", True) is False or (
            getattr(t, "lora_rank", 0) and not meta.get("lora")):
        return None  # weights only, or the base of a new LoRA run
    return path, int(meta["iteration"])


def load_checkpoint(config, chunks, model, optimizer, diloco=None) -> ResumeState:
    """Load `--load` into the model, optimizer, RNG (and DiLoCo's state: training/diloco.py
    `load_state`); returns where to start from
    (iteration 0 when there is no checkpoint yet and `--load` is also `--save`). Collective:
    every rank calls it; every rank raises the same `CheckpointError` on a bad checkpoint or
    a changed data config (`check_data_config`), before any training step and without
    touching the checkpoint."""
    t = config.train
    if not t.load:
        return ResumeState()
    if is_gguf(t.load):  # QLoRA's base as the file stores it (run_config/checks.py)
        return ResumeState(lora_base=load_gguf_base(config, chunks, t.load))
    path = resume_path(t)
    if path is None:
        if _same(t.save, t.load):
            _print0(f"no checkpoint in {t.load} yet (it is also --save): starting from scratch")
            return ResumeState()
        raise CheckpointError(f"--load {t.load}: no {LATEST} and no checkpoint folder there; "
                              f"pass a --save folder of an earlier run or an iter_XXXXXXX "
                              f"folder, or drop --load to start from scratch")
    if not os.path.isfile(os.path.join(t.load, LATEST)) and \
            os.path.dirname(os.path.normpath(path)) == os.path.normpath(t.load):
        _print0(f"{os.path.join(t.load, LATEST)} is missing (a save completed but its marker "
                f"was not written): resuming from the newest verified checkpoint {path}")
    meta = read_metadata(path)
    compare_model(meta, config.model.to_dict(), path)
    lora_base = None
    if t.lora_rank:  # the frozen base first (training/lora_checkpoint.py)
        lora_base = load_base(config, chunks, path, meta)
        if not meta.get("lora"):
            _print0(f"loaded the base of this LoRA run from {path}: adapters, iteration, "
                    f"optimizer and RNG start fresh")
            return ResumeState(lora_base=lora_base)
    else:
        refuse_lora_checkpoint(meta, path)
    weights_only = t.finetune or meta.get("optimizer_state", True) is False
    restart_data = not weights_only and check_data_config(meta, config, path)
    def verify(group):  # over a group of its own, as the loads (safe_dcp.load)
        expected = model_tensors(chunks, group=group)  # this run's model, metadata.json's
        verify_checkpoint(path, meta, lambda _: expected, group)

    collectives.in_transient_group("checkpoint verify", verify)
    md = safe_dcp.read_dcp_metadata(path, meta)  # on every rank (rank 0 checked it above)
    if weights_only:
        why = ("--finetune" if t.finetune else
               "it holds weights only (imported, e.g. by tools/convert_hf.py)")
        _load_states(path, md, config, chunks, model, optimizer, load_rng=False,
                     weights_only=True)
        if diloco is not None:  # the loaded weights are the global copy
            diloco.reset_global()
        _print0(f"loaded the weights of checkpoint {path} ({why}): iteration, optimizer and "
                f"RNG start fresh")
        return ResumeState(lora_base=lora_base)
    same_layout = meta["layout"]["world_size"] == config.world_size and all(
        meta["layout"].get(k, 1 if k in ("cp", "ep") else None) == v
        for k, v in _layout(config).items() if k in ("tp", "pp", "vpp", "cp", "ep"))
    iteration, consumed = _load_states(path, md, config, chunks, model, optimizer,
                                       load_rng=same_layout and t.load_rng)
    if diloco is not None:
        _print0(f"DiLoCo state from {path}: " + load_state(diloco, path, md, chunks, optimizer,
                                                           same_layout and t.load_optim))
    if not same_layout and t.load_rng:
        masks = ("dropout masks are keyed by sample, so they are the uninterrupted run's"
                 if t.dropout_masks == "sample" else
                 "--dropout-masks rank-streams draws other masks than the uninterrupted run")
        _print0(f"checkpoint layout ({_describe_layout(meta['layout'])}) differs from this "
                f"run's ({_describe_layout(_layout(config))}): the RNG streams start freshly "
                f"seeded; {masks}")
    position = DataPosition(consumed, consumed if restart_data else
                            int(meta.get("data_start_samples", 0)))
    _print0(f"loaded checkpoint {path} at iteration {iteration} ({consumed} samples consumed)")
    notice = elastic_notice(meta, config, iteration, consumed) or \
        batch_size_notice(meta, t.global_batch_size, iteration, consumed)
    for line in (notice, rejoin_warning(meta, config)):
        if line:
            _print0(line)
    return ResumeState(iteration, position, meta, lora_base)


def batch_size_notice(meta: dict, global_batch_size: int, iteration: int,
                      consumed: int) -> str | None:
    """The line a resume prints when this run's --global-batch-size differs from the one
    that wrote the checkpoint (`meta["global_batch_size"]`), else None."""
    saved = meta.get("global_batch_size")
    if saved is None or int(saved) == global_batch_size:
        return None
    return (f"--global-batch-size changed on resume: the checkpoint's run used {saved}, this "
            f"run {global_batch_size}; iterations continue from {iteration} and the data from "
            f"sample {consumed}, each iteration now {global_batch_size} samples (the LR "
            f"schedule and --train-iters count iterations, not samples)")


def check_data_config(meta: dict, config, path: str) -> bool:
    """Compare the checkpoint's data config (`data_config`) with this run's; True when they
    differ and --override-data-config makes the new data start from its first sample.
    Raises `CheckpointError` naming each difference without that flag."""
    saved = meta.get("data")
    if saved is None:  # written before the data config was recorded
        return False
    now = data_config(config)
    diffs = [f"{flag}: checkpoint {saved.get(k)!r}, this run {now[k]!r}"
             for k, flag in (("data_path", "--data-path"), ("split", "--split"),
                             ("seed", "--seed"), ("seq_length", "--seq-length"))
             if saved.get(k) != now[k]]
    if not diffs:
        return False
    if not config.train.override_data_config:
        raise CheckpointError(
            f"{os.path.join(path, METADATA)}: this run's data differs from the checkpoint's "
            f"({'; '.join(diffs)}), so resuming at sample {meta.get('consumed_samples')} would "
            f"read other samples than the run was reading; pass the checkpoint's values (see "
            f"{os.path.join(path, CONFIG)}), or --override-data-config to read the new data "
            f"from its beginning")
    consumed = int(meta.get("consumed_samples", 0))
    _print0(f"--override-data-config: the data differs from the checkpoint's "
            f"({'; '.join(diffs)}); the new data is read from its first sample (after "
            f"{consumed} samples of the old)")
    return True


def _load_states(path: str, md, config, chunks, model, optimizer, load_rng: bool,
                 weights_only: bool = False) -> tuple[int, int]:
    """(iteration, consumed_samples) of the checkpoint whose checked DCP metadata is `md`."""
    saved = md.state_dict_metadata
    with_optim = config.train.load_optim and not weights_only
    kinds = KINDS if with_optim else KINDS[:1]
    sd, plan = read_plan(path, saved, entries(chunks), kinds, buffer_entries(chunks))
    scalars = ("iteration", "optim.step", "consumed_samples")
    sd.update({k: torch.tensor(0) for k in scalars})
    if load_rng:
        sd.update({k: v.clone() for k, v in _rng_state().items()})
    safe_dcp.load(sd, path, md)
    values = rebuild(sd, plan)
    _apply(values, int(sd["optim.step"]), chunks, model, optimizer, with_optim=with_optim)
    if load_rng:
        _set_rng_state(sd)
    return int(sd["iteration"]), int(sd["consumed_samples"])


@torch.no_grad()
def _apply(values: dict, step: int, chunks, model, optimizer, with_optim: bool) -> None:
    """Copy loaded float32 TP-local tensors into parameters, buffers, main weights and
    moments."""
    load_buffers(values, chunks)
    params = [p for _, p, _, _ in entries(chunks)]
    wrapper = {id(p): ddp for ddp in model for p in ddp.params}
    for p in params:  # ZeRO-3: into the owned part of the parameter shards
        wrapper[id(p)].load_param_(p, values[id(p)]["model"])
    if isinstance(optimizer, DistributedOptimizer):
        for s in optimizer.shards:
            with optimizer.shard_state(s, write=True) as (main, exp_avg, exp_avg_sq):
                targets = [("model", main)] + ([("optim.exp_avg", exp_avg),
                                                ("optim.exp_avg_sq", exp_avg_sq)]
                                               if with_optim else [])
                for p, p_start, m_start, n in s.segments:
                    for kind, dst in targets:
                        dst[m_start: m_start + n].copy_(
                            values[id(p)][kind].reshape(-1)[p_start: p_start + n])
        if with_optim:
            optimizer.step_count = step
        return
    if with_optim and step > 0:
        for p in params:
            optimizer.state[p] = {
                "step": torch.tensor(float(step)),
                "exp_avg": values[id(p)]["optim.exp_avg"].to(p.device, p.dtype).clone(),
                "exp_avg_sq": values[id(p)]["optim.exp_avg_sq"].to(p.device, p.dtype).clone()}
