"""The pretraining run: resolved config -> grid -> data -> model -> optimizer -> iterations.

`pretrain(config)` is what `train.py` runs; tests call it too. It returns the list of metric
records it logged (every rank gets the same losses). This file holds the start-up
(`build_train_valid_data`, `setup_model_and_optimizer`, the measurements and the checkpoint
loaded) and the close (final save, the run's closing records); the iterations between them
are training/loop.py's `train`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import parallel_state as ps
from checkpoint.format import CheckpointError
from checkpoint.lora_files import is_gguf
from data_parallel.ddp import DistributedDataParallel, resolve_strategy
from data_parallel.distributed_optimizer import DistributedOptimizer
from layers import compile_transformer_layers, initial_value, parameters_on_meta
from layers.fp8 import apply_fp8, fp8_state_bytes
from layers.lora import add_lora
from layers.quantized import quantize_layer_linears, quantized_weights
from layers.recompute import apply_recompute
from models import GPTModel, T5Model
from models.config import ConfigError
from models.pipeline import build_model_chunks
from parallel_state import collectives
from parallel_state.schedule_tables import V_SHAPED
from parallel_state.hang_doctor import debug_collectives, trace
from parallel_state.transport import shm
from planner.activations import FrozenBase
from planner.flops import fp8_flops_share, training_flops_per_token
from planner.report import memory_prediction, run_end_summary
from run_config.batch_schedule import BatchSchedule, rampup_of
from run_config.fp8 import fp8_layers_kept, fp8_recipe

from .arguments import Config
from .diloco import DiLoCo
from .checkpointing import Checkpointer, completed_checkpoint, load_checkpoint, resume_path
from .batches import DataError, build_data, get_microbatches, vocab_extra_ids
from .loop import TrainState, pipeline_spec, print_rank_0, train
from .memory import activation_report, measure_activation_bytes, model_state_bytes
from .nonfinite import NonFiniteError
from .replicas import ReplicaMismatchError
from .metrics import MetricsLogger, log_run_end, run_start_record
from .mfu import PeakFlops
from .offload import prepare_offload_path, release_freed_host_memory
from .optimizer import build_optimizer, reconcile_schedule
from .schedules import get_forward_backward_func
from .timeline import report_bubble


# ---------------------------------------------------------------------- model
def zero3_init(config: Config) -> bool:
    """ZeRO-3 (--data-parallel-sharding-strategy optim_grads_params) builds the parameters on
    the meta device and makes them one unit at a time in the DDP wrapper (`param_init`), so no
    rank holds the whole model (data_parallel/fsdp.py)."""
    t = config.train
    return resolve_strategy(t.data_parallel_sharding_strategy,
                            t.use_distributed_optimizer) == "optim_grads_params"


def param_init(config: Config):
    """`param_init(name, param)` of a chunk's DDP wrapper: the seeded values of a meta-device
    parameter, as the chunk's `init_weights` makes them (layers.sharding.initial_value)."""
    m = config.model
    return functools.partial(initial_value, seed=config.train.seed, std=m.init_method_std,
                             num_layers=m.num_layers)


def build_model(config: Config, device) -> list[GPTModel]:
    """This rank's model chunks (one unless virtual pipelining), initialized from the seed,
    with LoRA adapters on a frozen base under --lora-rank; under ZeRO-3 (`zero3_init`) with
    their parameters on the meta device, not initialized (a LoRA run's base is built whole:
    frozen, it has nothing ZeRO shards; its adapters are sharded)."""
    t = config.train
    meta = zero3_init(config) and not t.lora_rank  # LoRA: the frozen base stays whole
    with parameters_on_meta() if meta else contextlib.nullcontext():
        if config.model.is_encoder_decoder:
            from run_config.checks import t5_stage_layers

            enc, dec = t5_stage_layers(config.model, t)[ps.get_pipeline_model_parallel_rank()]
            chunks = [T5Model(config.model, encoder_layer_numbers=enc,
                              decoder_layer_numbers=dec, sequence_parallel=t.sequence_parallel)]
        else:
            chunks = build_model_chunks(GPTModel, config.model, config.stage_num_layers(),
                                        ps.get_pipeline_model_parallel_rank(),
                                        t.virtual_pipeline_model_parallel_size,
                                        v_shape=t.pipeline_schedule in V_SHAPED,
                                        sequence_parallel=t.sequence_parallel,
                                        cp_comm_type=t.cp_comm_type)
        if t.lora_rank:  # adapters on the frozen base: only they train (layers/lora.py)
            for chunk in chunks:
                add_lora(chunk, t.lora_rank, t.lora_alpha, t.lora_dropout,
                         t.lora_target_modules, t.use_rslora)
    recipe = fp8_recipe(t)
    for chunk in chunks:
        if not meta:
            chunk.init_weights(t.seed)
        if t.bf16:  # Megatron's Float16Module: bf16 weights (the optimizer keeps fp32 copies)
            chunk.to(torch.bfloat16)
        if recipe is not None:  # FP8 GEMMs in the layer linears; float32 amax histories
            apply_fp8(chunk, recipe, config.model.num_layers, *fp8_layers_kept(config.model, t))
        apply_recompute(chunk, t.recompute_granularity, t.recompute_method,
                        t.recompute_num_layers)
        if t.compile:
            compile_transformer_layers(chunk)
    # meta parameters stay there (the DDP wrapper makes them on `device`); buffers move
    return [c._apply(lambda x: x if x.is_meta else x.to(device)) for c in chunks]


# ---------------------------------------------------------------------- the run
# Raised alike on every rank (before any training step, or from values all ranks share: the
# global loss and gradient norm, the replica check's world-wide verdict), with a message naming
# the fix: not a hang, so no trace dump.
_UNIFORM_ERRORS = (ConfigError, CheckpointError, DataError, NonFiniteError, ReplicaMismatchError)


def pretrain(config: Config, on_end=None) -> list[dict]:
    """Train as `config` says; returns the logged metric records (train and valid).

    `on_end(chunks)`, if given, runs on every rank after the last iteration while the grid is
    still up (tests use it to gather the final weights); its result is appended to the
    returned list as `{"on_end": result}`.
    """
    run_start = time.time()  # --exit-duration-in-mins counts from here
    t = config.train
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config.validate(world_size)  # before any process-group work
    done = completed_checkpoint(t)  # read alike on every rank, before any process group
    if done is not None and done[1] >= t.train_iters:
        if os.environ.get("RANK", "0") == "0":
            print(f"train.py: the job is already complete: {done[0]} is at iteration {done[1]}"
                  f" and --train-iters is {t.train_iters}; nothing was trained or written "
                  f"(raise --train-iters to train further)", flush=True)
        return []
    offload = prepare_offload_path(config)  # cleaned and checked before anything is built
    if offload and os.environ.get("RANK", "0") == "0":
        print(offload, flush=True)
    device = ps.initialize_distributed(None if t.device == "auto" else t.device,
                                       timeout=timedelta(minutes=t.distributed_timeout_minutes))
    if t.collective_trace_size and dist.get_world_size() > 1:
        trace.start_trace(t.log_dir, t.collective_trace_size)  # the hang doctor's recorder
    if t.debug_collectives:
        debug_collectives.enable()
    clean = False  # the run ended alike on every rank: the trace files can go
    try:
        with trace.dump_on_error(ignore=_UNIFORM_ERRORS):
            ps.initialize_model_parallel(t.tensor_model_parallel_size,
                                         t.pipeline_model_parallel_size,
                                         t.virtual_pipeline_model_parallel_size, device=device,
                                         expert_model_parallel_size=t.expert_model_parallel_size,
                                         expert_tensor_parallel_size=(
                                             t.expert_tensor_parallel_size),
                                         context_parallel_size=t.context_parallel_size,
                                         **pipeline_copies(config))
            records = _train(config, device, on_end, run_start)
            collectives.barrier()  # every rank got here, so nothing is left hanging
        clean = True
        return records
    except _UNIFORM_ERRORS:
        clean = True
        raise
    finally:
        debug_collectives.disable()
        trace.stop_trace(remove=clean)
        ps.destroy_model_parallel()


def pipeline_copies(config: Config) -> dict:
    """`initialize_model_parallel` keywords for the parameters several pipeline stages hold
    (T5 with --pipeline-model-parallel-split-rank): the embedding on the first encoder and
    first decoder stage (and the last, when tied), each position-bias table on every stage
    of its stack. For GPT the default first + last embedding group, or under ZBV (the V
    placement: both copies on stage 0, summed there) the embedding on stage 0 alone."""
    m, t = config.model, config.train
    split, pp = t.pipeline_model_parallel_split_rank, t.pipeline_model_parallel_size
    if pp > 1 and t.pipeline_schedule in V_SHAPED:
        return {"embedding_stages": [0], "pipeline_v_shape": True}
    if not m.is_encoder_decoder or pp == 1:
        return {}
    embedding = [0, split] + ([] if m.untie_embeddings_and_output_weights else [pp - 1])
    return {"embedding_stages": embedding,
            "stage_groups": {"encoder_position_bias": list(range(split)),
                             "decoder_position_bias": list(range(split, pp))}}


def vocab_notice(m, tokenizer_vocab: int, sentinels: int = 0) -> str:
    """The one line saying that the tokenizer's vocabulary (plus T5's `sentinels`) replaces
    the model file's, with the parameter counts of both (e.g. gpt2-124m on the 8192-token
    demo corpus)."""
    named = dataclasses.replace(m)
    actual = dataclasses.replace(m, vocab_size=tokenizer_vocab + sentinels)
    extra = f" + {sentinels} sentinels" if sentinels else ""
    # the named size needs a tokenizer that, with the sentinels on top, fills its vocabulary
    wanted = (f"a {m.vocab_size - sentinels}-token tokenizer (+ {sentinels} sentinels = "
              f"{m.vocab_size})" if sentinels else f"a {m.vocab_size}-token tokenizer")
    return (f"note: the tokenizer has {tokenizer_vocab} tokens{extra}, so the vocabulary of "
            f"{m.name or 'the model'} ({m.vocab_size}) is replaced by "
            f"{tokenizer_vocab + sentinels}: this run trains "
            f"{actual.num_parameters() / 1e6:.1f}M parameters, not "
            f"{named.num_parameters() / 1e6:.1f}M (for the named size, pass --data-path and "
            f"--tokenizer-model made with {wanted})")


def _train(config: Config, device, on_end=None, run_start: float | None = None) -> list[dict]:
    """One run on the grid `pretrain` set up: start-up, the iterations, the close."""
    t = config.train
    ps.model_parallel_seed(t.seed, ps.get_tensor_model_parallel_rank(),
                           ps.get_pipeline_model_parallel_rank(), device, t.dropout_masks)
    tokenizer, train_ds, valid_ds = build_train_valid_data(config, device)
    print_rank_0("building the model and optimizer")
    chunks, model, optimizer = setup_model_and_optimizer(config, device)
    if t.optimizer_cpu_offload or t.param_offload_device:
        release_freed_host_memory()  # the build's freed full copy of the model
    run = _start_run(config, device, run_start, tokenizer, train_ds, valid_ds, chunks, model,
                     optimizer)
    last, stop = train(run)
    return _finish_run(run, last, stop, on_end)


def build_train_valid_data(config: Config, device) -> tuple:
    """(tokenizer, train dataset, validation dataset or None), with the model's vocabulary
    settled against the tokenizer; then prints the run's summary and, on CPU, which
    transport each group's collectives take. Raises DataError (see `settle_vocab`)."""
    t = config.train
    print_rank_0(f"train.py: {config.world_size} process(es) on {device.type}; building the "
                 f"data ({' '.join(t.data_path) if t.data_path else 'the embedded demo corpus'})")
    tokenizer, train_ds, valid_ds = build_data(config)
    settle_vocab(config, tokenizer)
    print_rank_0(config.summary())
    if device.type == "cpu":
        for dim, size, group in (("tp", t.tensor_model_parallel_size,
                                  ps.get_tensor_model_parallel_group()),
                                 ("dp", ps.get_data_parallel_world_size(),
                                  ps.get_data_parallel_group()),
                                 ("cp", ps.get_context_parallel_world_size(),
                                  ps.get_context_parallel_group()),
                                 ("dp x cp", ps.get_data_parallel_world_size(True) if
                                  t.context_parallel_size > 1 and config.data_parallel_size > 1
                                  else 1, ps.get_data_parallel_group(True))):
            if size > 1:
                print_rank_0(f"{dim} collectives over " + (
                    f"shared memory ({shm.SHM_DIR}; {shm.ENV_SWITCH}=0 keeps gloo)"
                    if shm.channel(group) is not None else
                    "gloo (no shared-memory channel: ranks on several hosts, the switch off, "
                    "or no room in /dev/shm)"))
    return tokenizer, train_ds, valid_ds


def settle_vocab(config: Config, tokenizer) -> None:
    """Set the model's `vocab_size` from the tokenizer (plus T5's sentinels) where it should:
    from scratch always (printing `vocab_notice`), on resume when the checkpoint was saved so.
    Raises DataError when a model loaded from a checkpoint embeds fewer ids than the
    tokenizer has."""
    t, m = config.train, config.model
    gguf = is_gguf(t.load)  # a LoRA base kept as its GGUF file stores it: the file's vocab
    loads_weights = bool(t.load) and (gguf or resume_path(t) is not None)
    needed = tokenizer.vocab_size + vocab_extra_ids(config)  # T5: sentinels on top
    if loads_weights and not gguf and m.vocab_size != needed:
        from checkpoint.format import read_metadata

        if read_metadata(resume_path(t))["model"].get("vocab_size") == needed:
            # the run that saved it replaced the model file's vocabulary as a fresh run of
            # this command does (tokenizer + sentinels): the same command resumes it
            m.vocab_size = needed
            m.validate(t.tensor_model_parallel_size)
    if loads_weights and needed > m.vocab_size:
        raise DataError(f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} ids"
                        f"{' + the sentinels' if needed > tokenizer.vocab_size else ''} but the "
                        f"model loaded from {t.load} embeds only {m.vocab_size}; use the "
                        f"tokenizer the model was trained with (the one stored in the "
                        f"checkpoint is used when --tokenizer-model is not given)")
    if not loads_weights and m.vocab_size != needed:
        # from scratch, the tokenizer decides the vocabulary (a model loaded from a checkpoint
        # keeps its own, which may hold unused ids, as HF models often do)
        print_rank_0(vocab_notice(m, tokenizer.vocab_size, vocab_extra_ids(config)))
        m.vocab_size = needed
        m.validate(t.tensor_model_parallel_size)


def wrap_model(config: Config, chunks: list, device) -> list[DistributedDataParallel]:
    """Each chunk in its DistributedDataParallel wrapper, as the config says (sharding
    strategy, offload, bucket size; ZeRO-3 materializes meta-device parameters: `param_init`)."""
    t = config.train
    # routed experts reduce (and shard) over the expert-data-parallel group (the dp group at
    # ep 1, where nothing is split): data_parallel/ddp.py
    # dense weights reduce (and shard) over dp x cp: context-parallel ranks hold the same weights
    # DiLoCo: no gradient reduction over dp (the cp group: one rank, as cp 1 is required)
    diloco = t.diloco_sync_every is not None
    return [DistributedDataParallel(c, data_parallel_group=ps.get_context_parallel_group()
                                    if diloco else ps.get_data_parallel_group(True),
                                    expert_data_parallel_group=(
                                        ps.get_context_parallel_group() if diloco else
                                        ps.get_expert_data_parallel_group()),
                                    bucket_size=t.ddp_bucket_size,
                                    overlap_grad_reduce=t.overlap_grad_reduce,
                                    data_parallel_sharding_strategy=(
                                        t.data_parallel_sharding_strategy),
                                    param_offload_device=t.param_offload_device,
                                    offload_path=t.offload_path, rank=dist.get_rank(),
                                    io_threads=t.offload_io_threads,
                                    pin_memory=t.offload_pin_memory,
                                    param_init=param_init(config), device=device)
            for c in chunks]


def setup_model_and_optimizer(config: Config, device) -> tuple[list, list, object]:
    """(this rank's model chunks, their DistributedDataParallel wrappers, the optimizer):
    the DistributedOptimizer under --use-distributed-optimizer, --bf16 or
    --optimizer-cpu-offload, else AdamW."""
    t = config.train
    chunks = build_model(config, device)
    model = wrap_model(config, chunks, device)
    if t.use_distributed_optimizer or t.bf16 or t.optimizer_cpu_offload:
        # fp32 main weights (sharded over DP: ZeRO-1/2/3), optionally in host memory
        optimizer = DistributedOptimizer(
            model, lr=t.lr, weight_decay=t.weight_decay, betas=(t.adam_beta1, t.adam_beta2),
            eps=t.adam_eps, shard=t.use_distributed_optimizer,
            offload_fraction=t.optimizer_offload_fraction if t.optimizer_cpu_offload else 0.0,
            offload_device=t.optimizer_offload_device or "cpu", offload_path=t.offload_path,
            buffer_count=t.offload_buffer_count, buffer_size=t.offload_buffer_size,
            io_threads=t.offload_io_threads,
            pin_memory=t.offload_pin_memory, rank=dist.get_rank())
    else:
        optimizer = build_optimizer(torch.nn.ModuleList(chunks), lr=t.lr,
                                    weight_decay=t.weight_decay,
                                    betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
    return chunks, model, optimizer


def _start_run(config: Config, device, run_start, tokenizer, train_ds, valid_ds, chunks, model,
               optimizer) -> TrainState:
    """The measurements and state before the first iteration: MFU peak, memory report, the
    checkpoint loaded (or iteration 0), the run's length, the checkpointer and the metrics
    logger with its run_start record."""
    t, m = config.train, config.model
    params = [p for c in chunks for p in c.parameters() if p.requires_grad]
    forward_backward = get_forward_backward_func(config.train.pipeline_schedule)
    spec = pipeline_spec(config, device)

    flops_per_token = training_flops_per_token(m)
    fp8_share = 0.0 if t.fp8_format is None else fp8_flops_share(m, *fp8_layers_kept(m, t))
    peak = PeakFlops(device, torch.bfloat16 if t.bf16 else torch.float32, t.peak_tflops,
                     fp8_share)
    diloco = DiLoCo(params, t.diloco_sync_every, t.diloco_outer_lr, t.diloco_outer_momentum) \
        if t.diloco_sync_every else None
    if diloco is not None:
        print_rank_0(diloco.describe())
    # iteration 0: from scratch
    resume = load_checkpoint(config, chunks, model, optimizer, diloco=diloco)
    if t.lora_base_quantization not in ("none", "gguf"):  # QLoRA: the loaded base, low-bit
        print_rank_0(quantize_base(chunks, t.lora_base_quantization))
    # after the base is loaded (and held low-bit): the memory it takes is what is measured
    memory = log_memory(model, optimizer, train_ds, config, device)
    start_iteration, position = resume.iteration, resume.position
    batches = BatchSchedule(t.global_batch_size, rampup_of(t))
    if t.train_samples:  # the steps left to reach --train-samples from where we are
        t.train_iters = start_iteration + batches.steps_to(position.consumed_samples,
                                                           t.train_samples)
    note = reconcile_schedule(t, (resume.meta or {}).get("opt_param_scheduler"),
                              start_iteration)
    if note:
        print_rank_0(note)
    checkpointer = Checkpointer(config, tokenizer=tokenizer.path, diloco=diloco) \
        if t.save else None
    if checkpointer is not None:
        checkpointer.lora_base = resume.lora_base
    is_logger = dist.get_rank() == 0
    logger = MetricsLogger(t.log_dir, enabled=is_logger, tensorboard=t.tensorboard is not False,
                           run_start=run_start_record(config, start_iteration, peak,
                                                      flops_per_token, memory))
    print_rank_0(f"MFU: {flops_per_token / 1e6:.2f} MFLOP per token (model FLOPs: matmuls, 3x "
                 f"forward) against a peak of {peak.describe()}")
    return TrainState(config, device, train_ds, valid_ds, chunks, model, optimizer, params,
                      forward_backward, spec, flops_per_token, peak, start_iteration, position,
                      batches, checkpointer, logger, is_logger, run_start, diloco=diloco)


def _finish_run(run: TrainState, last: int, stop: str | None, on_end) -> list[dict]:
    """After the iterations: the final save (unless iteration `last` was just saved), the
    exit record of a run stopped early, the bubble and --report-comm summaries, the run_end
    record; then `on_end(chunks)` with the weights synced. Returns the run's records."""
    t, records, checkpointer = run.config.train, run.records, run.checkpointer
    if checkpointer:
        if checkpointer.last_saved != last:
            checkpointer.save(last, run.chunks, run.model, run.optimizer, run.position)
        checkpointer.wait()
    if stop is not None:
        saved = (f"checkpoint iter {last} is in {t.save}; the same command resumes from it"
                 if checkpointer else "no --save, so nothing was saved")
        rec = {"iteration": last, "event": "exit", "reason": stop,
               "consumed_samples": run.position.consumed_samples}
        run.logger.log(rec, f"{stop}: {saved}", prefix="exit")
        records.append(rec)
    bubble = report_bubble(run.profiles, run.config, run.logger) if run.profiles else None
    if bubble is not None:
        records.append(bubble)
    if t.report_comm:
        rec, line = run_end_summary(run.config, run.comm, bubble)
        run.logger.log(dict(rec, iteration=last), line, prefix="planner")
        records.append(rec)
    if last > run.start_iteration:
        records.append(log_run_end(run.config, run.start_iteration, last,
                                   time.time() - run.start, run.progress, run.peak,
                                   run.flops_per_token, run.logger, dist.get_world_size(),
                                   run.is_logger))
    run.logger.close()
    for ddp in run.model:  # weights are read outside a forward from here on (ZeRO-3: only by
        if on_end is not None or ddp.units is None:  # on_end; gathering every unit would
            ddp.finish_param_sync()  # hold the whole model, which offload runs cannot)
    if on_end is not None:
        records.append({"on_end": on_end(run.chunks)})
    for ddp in run.model:
        ddp.release_params()
    if isinstance(run.optimizer, DistributedOptimizer):
        run.optimizer.close()  # the NVMe scratch files go (checkpoints never need them)
    for ddp in run.model:
        ddp.close_offload()
    return records


def quantize_base(chunks, fmt: str) -> str:
    """Hold the frozen base's layer linears of this rank's `chunks` in `fmt` (QLoRA;
    layers/quantized.py `quantize_layer_linears`, groups of 32 for int4); the line saying
    what it did (rank 0's bytes before and after)."""
    before = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters()
                 if not p.requires_grad)
    count = sum(quantize_layer_linears(c, fmt) for c in chunks)
    after = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters()
                if not p.requires_grad) + sum(w.nbytes for c in chunks
                                              for _, w in quantized_weights(c))
    return (f"QLoRA: {count} frozen base weights of this rank held as {fmt}; the frozen base "
            f"{before / 2**20:,.1f} -> {after / 2**20:,.1f} MiB (rank 0)")


def log_memory(model, optimizer, dataset, config: Config, device) -> dict:
    """Measure model-state and activation bytes on every rank; print one plain line on rank 0
    and return the detailed accounting (beside the ZeRO and Korthikanti et al. formulas) for
    the run_start record of metrics.jsonl."""
    state = model_state_bytes(model, optimizer)
    state["fp8_buffers"] = fp8_state_bytes(model)  # amax histories (delayed), not a model state
    act = log_activation_memory(model, dataset, config, device)
    if config.model.is_encoder_decoder:
        planner = {"planner_model_state_ratio": None, "planner_activation_ratio": None}
        line = ("note: the planner (tools/plan.py) models decoder-only runs; this T5 run "
                "gets no prediction")
    else:
        planner, line = memory_prediction(config, ps.get_pipeline_model_parallel_rank(), {
            "model_state_total_bytes": state["total"],
            "frozen_base_bytes": state["frozen_params"] + state["frozen_low_bit"],
            "fp8_buffer_bytes": state["fp8_buffers"],
            "activation_bytes_per_microbatch": act["activation_bytes_per_microbatch"]},
            base_formats(model, config))
    ranks = [None] * dist.get_world_size()  # (measured total, planner's two ratios) per rank
    collectives.all_gather_object(ranks, (
        state["total"] + state["frozen_params"] + state["frozen_low_bit"] +
        state["fp8_buffers"] + act["activation_bytes_per_microbatch"],
        planner["planner_model_state_ratio"], planner["planner_activation_ratio"]))
    totals = [r[0] for r in ranks]
    planner["planner_model_state_ratio_per_rank"] = [r[1] for r in ranks]
    planner["planner_activation_ratio_per_rank"] = [r[2] for r in ranks]
    print_rank_0(memory_line(config, state, act, totals))
    print_rank_0(line)
    return {**act, **{f"model_state_{k}" + ("" if k in _STATE_COUNTS else "_bytes"): v
                      for k, v in state.items()}, "memory_bytes_per_rank": totals, **planner}


def memory_line(config: Config, state: dict, act: dict, totals: list[int]) -> str:
    """`log_memory`'s line: rank 0's model-state bytes (`model_state_bytes` `state`) with its
    strategy and the group it shards over, under FP8 its FP8 buffers (`state["fp8_buffers"]`,
    layers/fp8.py `fp8_state_bytes`), its activations (`act`), the largest of the ranks'
    `totals`, in MiB. Under DiLoCo the replicas reduce over no group (each holds whole
    states): the line names the data-parallel size and says so."""
    mib = lambda x: f"{x / 2**20:,.1f}"  # noqa: E731
    largest = max(range(len(totals)), key=lambda r: totals[r])
    host = f", host {mib(state['host_total'])}" if state["host_total"] else ""
    host += f", NVMe {mib(state['nvme_total'])}" if state["nvme_total"] else ""
    gathered = (f", gathered up to {mib(state['gathered_params_predicted_peak'])}"
                if "gathered_params_predicted_peak" in state else "")
    experts = f" (experts at edp {state['edp']})" if state["edp"] != state["dp"] else ""
    over = "dp x cp" if config.train.context_parallel_size > 1 else "dp"  # the sharding group
    group = f"{over} {state['dp']}{experts}"
    if config.train.diloco_sync_every is not None:  # the wrappers' group is one rank
        group = (f"dp {config.data_parallel_size} (DiLoCo: each replica holds whole states, "
                 f"nothing reduced over dp between syncs)")
    frozen_low_bit = state.get("frozen_low_bit", 0)  # 0 when a caller passes no frozen base
    frozen = state.get("frozen_params", 0) + frozen_low_bit
    low_bit = f" (low-bit {mib(frozen_low_bit)})" if frozen_low_bit else ""
    t = config.train
    fp8 = "" if t.fp8_format is None else (
        f"FP8 buffers {state.get('fp8_buffers', 0) / 2**10:,.1f} KiB ({t.fp8_recipe}: "
        + ("amax histories" if t.fp8_recipe == "delayed" else "scales computed per GEMM")
        + ", no cached FP8 weight copies) + ")
    return (
        f"memory (rank 0, MiB): model states {mib(state['total'])} "
        f"({'adapters' if config.train.lora_rank else 'weights'} "
        f"{mib(state['params'])}, gradients {mib(state['grads'])}, optimizer "
        f"{mib(state['main_params'] + state['optimizer_states'])}; {state['strategy']} at "
        f"{group}, ZeRO formula {mib(state['predicted_total'])}{host}{gathered}) + "
        + (f"frozen base {mib(frozen)}{low_bit} + " if frozen else "") + fp8
        + ("activations not measured (T5)" if config.model.is_encoder_decoder else
           f"activations {mib(act['activation_bytes_per_microbatch'])} per microbatch (the "
           f"decoder layers' {mib(act['activation_bytes_layers'])}, predicted "
           f"{mib(act['activation_bytes_layers_predicted'])})") +
        (f"; largest rank {largest}: {mib(totals[largest])}" if len(totals) > 1 else "") +
        "; details in metrics.jsonl")


def base_formats(model, config: Config) -> dict | None:
    """`{parameter name: format}` of the low-bit weights of a base kept as its GGUF file
    stores it (--lora-base-quantization gguf), for the planner's prediction of its bytes;
    None otherwise (the planner knows the format from the flag)."""
    if config.train.lora_base_quantization != "gguf":
        return None
    return {name: w.format for d in model for name, w in quantized_weights(d.module)}


_STATE_COUNTS = ("psi", "psi_padded", "dp", "edp", "strategy")  # model-state fields not in bytes


def log_activation_memory(chunks, dataset, config: Config, device) -> dict:
    """`chunks`: the DistributedDataParallel wrappers (ZeRO-3 gathers through them).
    Measure the activation bytes one microbatch saves for backward on this rank (RNG
    untouched) and return them beside the predictions: the total, the decoder layers' share,
    and the layers' model-specific and Korthikanti et al. predictions (training/memory.py)."""
    t = config.train
    if config.model.is_encoder_decoder:
        print_rank_0("note: activation memory is measured and predicted for decoder-only "
                     "models only; this T5 run reports none (its formulas are not written)")
        return {k: 0 for k in ("activation_bytes_per_microbatch", "activation_bytes_layers",
                               "activation_bytes_layers_predicted",
                               "activation_bytes_layers_paper")}
    batch = get_microbatches(dataset, 0, config, device)[0]  # sample 0: any would do
    dtype = next(chunks[0].parameters()).dtype
    # --compile: measure the eager layers (saved-tensor hooks do not see inside a compiled
    # graph, whose own choice of saved tensors can only be smaller)
    with torch.compiler.set_stance("force_eager") if t.compile else contextlib.nullcontext():
        measured = measure_activation_bytes(chunks, batch,
                                            pipeline_spec(config, device).shapes[0], dtype=dtype)
    report = activation_report(config.model, measured, micro_batch_size=t.micro_batch_size,
                               tp=t.tensor_model_parallel_size, sp=t.sequence_parallel,
                               granularity=t.recompute_granularity, method=t.recompute_method,
                               recompute_num_layers=t.recompute_num_layers, dtype=dtype,
                               keyed_dropout=t.dropout_masks == "sample",
                               cp=t.context_parallel_size, lora=FrozenBase.of(t))
    return {"activation_bytes_per_microbatch": report["activation_bytes_per_microbatch"],
            "activation_bytes_layers": report["activation_bytes_layers"],
            "activation_bytes_layers_predicted": report["activation_bytes_layers_model_predicted"],
            "activation_bytes_layers_paper": report["activation_bytes_layers_paper_predicted"]}
