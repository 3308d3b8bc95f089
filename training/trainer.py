"""The pretraining loop: resolved config -> grid -> data -> model -> optimizer -> iterations.

`pretrain(config)` is what `train.py` runs; tests call it too. It returns the list of metric
records it logged (every rank gets the same losses).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.profiler import record_function

import parallel_state as ps
from checkpoint.format import CheckpointError
from layers import compile_transformer_layers
from models import GPTModel, T5Model
from models.config import ConfigError
from models.pipeline import build_model_chunks
from parallel_state import collectives, debug_collectives, shm, trace
from parallel_state.comm_counter import CommCounter
from parallel_state.p2p import TensorSpec

from .arguments import Config
from .batch_schedule import BatchSchedule, rampup_of
from .checkpointing import (Checkpointer, completed_checkpoint, kill_hook, load_checkpoint,
                            resume_path, signal_hook)
from .batches import DataError, build_data, get_microbatches, vocab_extra_ids
from .data import batch_digest
from .distributed import (DistributedDataParallel, all_reduce_embedding_grads,
                          all_reduce_sequence_parallel_grad_pieces)
from .distributed_optimizer import DistributedOptimizer
from .flops import PeakFlops, training_flops_per_token
from .fsdp import peak_gathered_bytes
from .memory import (activation_report, measure_activation_bytes, model_state_bytes,
                     peak_memory_bytes)
from .nonfinite import (NonFiniteError, StepGuard, grads_outside_norm, inject_grad_for_test,
                        inject_loss_for_test)
from .replicas import ReplicaMismatchError, check_replicas
from .metrics import (EvalProgress, MetricsLogger, Progress, format_duration,
                      log_run_end, run_start_record)
from .optimizer import build_optimizer, clip_grads, learning_rate, reconcile_schedule
from .planner.report import log_comm, memory_prediction, run_end_summary
from .preemption import ExitCheck
from .recompute import apply_recompute
from .profiling import StepProfiler
from .schedules import get_forward_backward_func
from .timeline import Timeline, gather_timeline, report_bubble


def _rank0_print(*args) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def _global_sum(x: torch.Tensor, group) -> torch.Tensor:
    x = x.clone()
    if dist.get_world_size(group) > 1:
        collectives.all_reduce(x, group=group)
    return x


def pipeline_spec(config: Config, device) -> TensorSpec:
    """What adjacent stages exchange: hidden states `[s, b, h]` (`[s/tp, b, h]` under SP).

    T5 (Megatron's encoder-and-decoder pipeline): encoder stages pass the encoder hidden
    `[se, b, h]`; the first decoder stage receives the encoder output, and every decoder
    stage passes `(decoder hidden [sd, b, h], encoder output [se, b, h])`."""
    m, t = config.model, config.train
    sp = t.tensor_model_parallel_size if t.sequence_parallel else 1
    dtype = torch.bfloat16 if t.bf16 else torch.float32
    b, h = t.micro_batch_size, m.hidden_size
    enc = (m.seq_length // sp, b, h)
    if not m.is_encoder_decoder:
        return TensorSpec(shapes=(enc,), dtype=dtype, device=device)
    dec = (m.decoder_seq_length // sp, b, h)
    rank, split = ps.get_pipeline_model_parallel_rank(), t.pipeline_model_parallel_split_rank
    received = (enc,) if split is None or rank <= split else (dec, enc)
    sent = (enc,) if split is not None and rank < split else (dec, enc)
    return TensorSpec(shapes=received, dtype=dtype, device=device, next_shapes=sent)


def global_loss_sum(loss_sum: torch.Tensor) -> torch.Tensor:
    """Sum of token losses of the global batch, on every rank (the loss lives on the last
    pipeline stage of each DP replica)."""
    loss_sum = _global_sum(loss_sum, ps.get_pipeline_model_parallel_group())
    return _global_sum(loss_sum, ps.get_data_parallel_group())


def evaluate(chunks, dataset, config: Config, device, progress=None) -> float:
    """Mean token loss (nats) over `eval_iters` global batches of the validation split;
    `progress(batches done)`, if given, is called after each (metrics.EvalProgress)."""
    forward_backward = get_forward_backward_func()
    spec = pipeline_spec(config, device)
    for c in chunks:
        c.eval()
    loss_sum = torch.zeros((), device=device)
    tokens = torch.zeros((), device=device)
    for i in range(config.train.eval_iters):
        mbs = get_microbatches(dataset, i * config.train.global_batch_size, config, device)
        loss_sum += forward_backward(model=chunks, microbatches=mbs, loss_scale=1.0, spec=spec,
                                     forward_only=True)
        tokens += sum(mb["loss_mask"].sum() for mb in mbs)
        if progress is not None:
            progress(i + 1)
    for c in chunks:
        c.train()
    return float(global_loss_sum(loss_sum) / _global_sum(tokens, ps.get_data_parallel_group()))


# ---------------------------------------------------------------------- model
def build_model(config: Config, device) -> list[GPTModel]:
    """This rank's model chunks (one unless virtual pipelining), initialized from the seed."""
    t = config.train
    if config.model.is_encoder_decoder:
        from .config_checks import t5_stage_layers

        enc, dec = t5_stage_layers(config.model, t)[ps.get_pipeline_model_parallel_rank()]
        chunks = [T5Model(config.model, encoder_layer_numbers=enc, decoder_layer_numbers=dec,
                          sequence_parallel=t.sequence_parallel)]
    else:
        chunks = build_model_chunks(GPTModel, config.model, config.stage_num_layers(),
                                    ps.get_pipeline_model_parallel_rank(),
                                    t.virtual_pipeline_model_parallel_size,
                                    sequence_parallel=t.sequence_parallel)
    for chunk in chunks:
        chunk.init_weights(t.seed)
        if t.bf16:  # Megatron's Float16Module: bf16 weights (the optimizer keeps fp32 copies)
            chunk.to(torch.bfloat16)
        apply_recompute(chunk, t.recompute_granularity, t.recompute_method,
                        t.recompute_num_layers)
        if t.compile:
            compile_transformer_layers(chunk)
    return [c.to(device) for c in chunks]


# ---------------------------------------------------------------------- main loop
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
    of its stack. Empty for GPT (the default first + last embedding group)."""
    m, t = config.model, config.train
    split, pp = t.pipeline_model_parallel_split_rank, t.pipeline_model_parallel_size
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
    t, m = config.train, config.model
    ps.model_parallel_seed(t.seed, ps.get_tensor_model_parallel_rank(),
                           ps.get_pipeline_model_parallel_rank(), device, t.dropout_masks)
    _rank0_print(f"train.py: {config.world_size} process(es) on {device.type}; building the "
                 f"data ({' '.join(t.data_path) if t.data_path else 'the embedded demo corpus'})")
    tokenizer, train_ds, valid_ds = build_data(config)
    loads_weights = bool(t.load) and resume_path(t) is not None
    needed = tokenizer.vocab_size + vocab_extra_ids(config)  # T5: sentinels on top
    if loads_weights and m.vocab_size != needed:
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
        _rank0_print(vocab_notice(m, tokenizer.vocab_size, vocab_extra_ids(config)))
        m.vocab_size = needed
        m.validate(t.tensor_model_parallel_size)
    _rank0_print(config.summary())
    if device.type == "cpu":
        for dim, size, group in (("tp", t.tensor_model_parallel_size,
                                  ps.get_tensor_model_parallel_group()),
                                 ("dp", ps.get_data_parallel_world_size(),
                                  ps.get_data_parallel_group())):
            if size > 1:
                _rank0_print(f"{dim} collectives over " + (
                    f"shared memory ({shm.SHM_DIR}; {shm.ENV_SWITCH}=0 keeps gloo)"
                    if shm.channel(group) is not None else
                    "gloo (no shared-memory channel: ranks on several hosts, the switch off, "
                    "or no room in /dev/shm)"))
    _rank0_print("building the model and optimizer")

    chunks = build_model(config, device)
    model = [DistributedDataParallel(c, data_parallel_group=ps.get_data_parallel_group(),
                                     bucket_size=t.ddp_bucket_size,
                                     overlap_grad_reduce=t.overlap_grad_reduce,
                                     data_parallel_sharding_strategy=(
                                         t.data_parallel_sharding_strategy))
             for c in chunks]
    if t.use_distributed_optimizer or t.bf16 or t.optimizer_cpu_offload:
        # fp32 main weights (sharded over DP: ZeRO-1/2/3), optionally in host memory
        optimizer = DistributedOptimizer(
            model, lr=t.lr, weight_decay=t.weight_decay, betas=(t.adam_beta1, t.adam_beta2),
            eps=t.adam_eps, shard=t.use_distributed_optimizer,
            offload_fraction=t.optimizer_offload_fraction if t.optimizer_cpu_offload else 0.0)
    else:
        optimizer = build_optimizer(torch.nn.ModuleList(chunks), lr=t.lr,
                                    weight_decay=t.weight_decay,
                                    betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
    params = [p for c in chunks for p in c.parameters() if p.requires_grad]
    forward_backward = get_forward_backward_func()
    spec = pipeline_spec(config, device)

    flops_per_token = training_flops_per_token(m)
    peak = PeakFlops(device, torch.bfloat16 if t.bf16 else torch.float32, t.peak_tflops)
    memory = log_memory(model, optimizer, train_ds, config, device)
    resume = load_checkpoint(config, chunks, model, optimizer)  # iteration 0: from scratch
    start_iteration, position = resume.iteration, resume.position
    batches = BatchSchedule(t.global_batch_size, rampup_of(t))
    if t.train_samples:  # the steps left to reach --train-samples from where we are
        t.train_iters = start_iteration + batches.steps_to(position.consumed_samples,
                                                           t.train_samples)
    note = reconcile_schedule(t, (resume.meta or {}).get("opt_param_scheduler"),
                              start_iteration)
    if note:
        _rank0_print(note)
    checkpointer = Checkpointer(config, tokenizer=tokenizer.path) if t.save else None
    is_logger = dist.get_rank() == 0
    logger = MetricsLogger(t.log_dir, enabled=is_logger, tensorboard=t.tensorboard is not False,
                           run_start=run_start_record(config, start_iteration, peak,
                                                      flops_per_token, memory))
    _rank0_print(f"MFU: {flops_per_token / 1e6:.2f} MFLOP per token (model FLOPs: matmuls, 3x "
                 f"forward) against a peak of {peak.describe()}")

    records, profiles = [], []
    decay_iters = t.lr_decay_iters or t.train_iters
    evaluating = valid_ds is not None and bool(t.eval_interval)
    progress = Progress(t.train_iters, t.eval_interval if evaluating else 0, t.save_interval,
                        save_at_end=checkpointer is not None)
    if evaluating and start_iteration == 0:
        # the starting point, so a run shows how far validation loss fell
        records.append(_validate(model, valid_ds, config, device, logger, 0, progress))
    for ddp in model:
        ddp.zero_grad_buffer()  # ZeRO-3: frees what the measurements above left gathered
    peak_gathered_bytes(reset=True)
    _rank0_print(f"training iterations {start_iteration + 1}..{t.train_iters}; the first step "
                 f"also does one-time set-up (allocation, warm-up)")
    start = time.time()
    exit_check = ExitCheck(t, run_start or start)
    profiler = StepProfiler(t, t.log_dir, device)
    stop = None
    guard = StepGuard(t.check_for_nan_in_loss_and_grad, t.max_skipped_iters)
    # --report-comm counts the second step (a steady one) when there is one, else the first
    counted_step = start_iteration + (1 if t.train_iters > start_iteration + 1 else 0)
    counter = CommCounter() if t.report_comm else None
    comm = None
    try:
        for iteration in range(start_iteration, t.train_iters):
            profiler.before(iteration)
            step_start = time.perf_counter()
            gbs = batches.size(position.consumed_samples)
            if counter is not None and iteration == counted_step:
                counter.begin()
            if t.train_samples:  # the schedule counts samples, this step's included
                lr = learning_rate(position.consumed_samples + gbs - 1, lr=t.lr, min_lr=t.min_lr,
                                   warmup_iters=t.lr_warmup_samples,
                                   decay_iters=t.lr_decay_samples, style=t.lr_decay_style)
            else:
                lr = learning_rate(iteration, lr=t.lr, min_lr=t.min_lr,
                                   warmup_iters=t.lr_warmup_iters, decay_iters=decay_iters,
                                   style=t.lr_decay_style)
            for group in optimizer.param_groups:
                group["lr"] = lr
            data_start = position.data_index
            with record_function("shardzoo.data"):
                microbatches = get_microbatches(train_ds, data_start, config, device, gbs)
            signal_hook(iteration + 1)  # test hook; no-op unless its env var is set
            num_tokens = _global_sum(sum(mb["loss_mask"].sum() for mb in microbatches),
                                     ps.get_data_parallel_group())
            for ddp in model:
                ddp.zero_grad_buffer()
            timeline = Timeline() if t.profile_pipeline and iteration > 0 else None
            hooks = inject_grad_for_test(iteration + 1, params)  # no-op unless testing
            loss_sum = forward_backward(model=model, microbatches=microbatches,
                                        loss_scale=1.0 / float(num_tokens), spec=spec,
                                        timeline=timeline)
            for hook in hooks:
                hook.remove()
            for ddp in model:
                ddp.finish_grad_sync()
            all_reduce_sequence_parallel_grad_pieces(model)
            all_reduce_embedding_grads(model)
            loss_sum = inject_loss_for_test(iteration + 1, loss_sum)
            with record_function("shardzoo.optimizer"):
                if isinstance(optimizer, DistributedOptimizer):
                    grad_norm = optimizer.clip_grad_norm(t.clip_grad)
                else:
                    grad_norm = clip_grads(params, t.clip_grad)
                loss = float(global_loss_sum(loss_sum) / num_tokens)  # the same on every rank
                skipped = guard.skip_reason(loss, grad_norm,
                                            grads_outside_norm(optimizer, params), loss_sum)
                if skipped is None:
                    optimizer.step()
            position.consumed_samples += gbs
            counted = counter.stop() if counter is not None and counter.active else None
            profile = profiler.after(iteration, logger)
            if profile is not None:
                records.append(profile)
            progress.step(time.perf_counter() - step_start)
            if timeline is not None:  # instrumentation: not the step's time or traffic
                profiles.append(gather_timeline(timeline))
            if counted is not None:  # after the step's timing
                comm = log_comm(config, counted, gbs, iteration + 1, logger,
                                first_step=iteration == start_iteration)
                records.append(comm)
            it = iteration + 1
            in_a_row = guard.record(skipped)
            if skipped is not None:
                rec = {"iteration": it, "event": "skipped", "reason": skipped, "loss": loss,
                       "grad_norm": grad_norm, "consecutive": in_a_row}
                limit = f" of {t.max_skipped_iters} allowed" if t.max_skipped_iters else ""
                logger.log(rec, f"iter {it:6d}/{t.train_iters} | step skipped: {skipped} "
                                f"(weights and optimizer unchanged; {in_a_row} in a "
                                f"row{limit})", prefix="skip")
                records.append(rec)
            guard.stop_if_needed(it, skipped, loss, grad_norm)
            if t.check_weight_hash_across_dp_replicas_interval and \
                    it % t.check_weight_hash_across_dp_replicas_interval == 0:
                check_replicas(model, it)
            if skipped is None and (it % t.log_interval == 0 or it == t.train_iters
                                    or it == start_iteration + 1):
                step_time = progress.window()  # training steps only: no validation or saving
                tps = gbs * m.seq_length / step_time  # this step's batch (ramp-up)
                tflops = flops_per_token * tps / dist.get_world_size() / 1e12
                mfu = peak.mfu(tflops) if is_logger else None
                eta = progress.eta(it)
                rec = {"iteration": it, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                       "tokens_per_s": tps, "tflops": tflops, "mfu": mfu,
                       "memory": peak_memory_bytes(device), "step_time_s": step_time,
                       **({"gathered_params_peak_bytes": peak_gathered_bytes()}
                          if t.data_parallel_sharding_strategy == "optim_grads_params" else {}),
                       "elapsed_s": time.time() - start, "eta_s": eta,
                       "consumed_samples": position.consumed_samples,
                       "global_batch_size": gbs,
                       "samples_digest": batch_digest(train_ds, data_start, gbs)}
                if is_logger:
                    peak.say_note()
                logger.log(rec, f"iter {it:6d}/{t.train_iters} | loss {loss:.4f} | lr {lr:.3e} | "
                                f"grad norm {grad_norm:.3f} | {tps:,.0f} tok/s | "
                                f"{tflops:.3f} TFLOP/s/dev | mfu "
                                f"{'n/a' if mfu is None else f'{mfu:.1%}'} | "
                                f"mem {rec['memory'] / 2**20:,.0f} MiB | "
                                f"elapsed {format_duration(rec['elapsed_s'])} | "
                                f"eta {format_duration(eta)}")
                records.append(rec)
            if evaluating and (it % t.eval_interval == 0 or it == t.train_iters):
                records.append(_validate(model, valid_ds, config, device, logger, it, progress))
            if checkpointer and t.save_interval and it % t.save_interval == 0 and \
                    skipped is None:  # a save never ends a streak of skipped steps
                save_start = time.perf_counter()
                checkpointer.save(it, chunks, model, optimizer, position)
                progress.other("save", time.perf_counter() - save_start)
            kill_hook(it)  # test hook (training/checkpointing.py); no-op unless its env var is set
            stop = exit_check.reason(it)
            if stop is not None:
                break
    except NonFiniteError:
        if checkpointer:
            checkpointer.wait()  # an earlier, good save still being written completes
        raise
    finally:
        exit_check.close()
    last = it if stop is not None else max(start_iteration, t.train_iters)
    if checkpointer:
        if checkpointer.last_saved != last:
            checkpointer.save(last, chunks, model, optimizer, position)
        checkpointer.wait()
    if stop is not None:
        saved = (f"checkpoint iter {last} is in {t.save}; the same command resumes from it"
                 if checkpointer else "no --save, so nothing was saved")
        rec = {"iteration": last, "event": "exit", "reason": stop,
               "consumed_samples": position.consumed_samples}
        logger.log(rec, f"{stop}: {saved}", prefix="exit")
        records.append(rec)
    bubble = report_bubble(profiles, config, logger) if profiles else None
    if bubble is not None:
        records.append(bubble)
    if t.report_comm:
        rec, line = run_end_summary(config, comm, bubble)
        logger.log(dict(rec, iteration=last), line, prefix="planner")
        records.append(rec)
    if last > start_iteration:
        records.append(log_run_end(config, start_iteration, last, time.time() - start,
                                   progress, peak, flops_per_token, logger,
                                   dist.get_world_size(), is_logger))
    logger.close()
    for ddp in model:
        ddp.finish_param_sync()  # weights are read outside a forward from here on
    if on_end is not None:
        records.append({"on_end": on_end(chunks)})
    for ddp in model:
        ddp.release_params()
    return records


def log_memory(model, optimizer, dataset, config: Config, device) -> dict:
    """Measure model-state and activation bytes on every rank; print one plain line on rank 0
    and return the detailed accounting (beside the ZeRO and Korthikanti et al. formulas) for
    the run_start record of metrics.jsonl."""
    state = model_state_bytes(model, optimizer)
    act = log_activation_memory(model, dataset, config, device)
    if config.model.is_encoder_decoder:
        planner = {"planner_model_state_ratio": None, "planner_activation_ratio": None}
        line = ("note: the planner (tools/plan.py) models decoder-only runs; this T5 run "
                "gets no prediction")
    else:
        planner, line = memory_prediction(config, ps.get_pipeline_model_parallel_rank(), {
            "model_state_total_bytes": state["total"],
            "activation_bytes_per_microbatch": act["activation_bytes_per_microbatch"]})
    ranks = [None] * dist.get_world_size()  # (measured total, planner's two ratios) per rank
    collectives.all_gather_object(ranks, (
        state["total"] + act["activation_bytes_per_microbatch"],
        planner["planner_model_state_ratio"], planner["planner_activation_ratio"]))
    totals = [r[0] for r in ranks]
    planner["planner_model_state_ratio_per_rank"] = [r[1] for r in ranks]
    planner["planner_activation_ratio_per_rank"] = [r[2] for r in ranks]
    mib = lambda x: f"{x / 2**20:,.1f}"  # noqa: E731
    largest = max(range(len(totals)), key=lambda r: totals[r])
    host = f", host {mib(state['host_total'])}" if state["host_total"] else ""
    gathered = (f", gathered up to {mib(state['gathered_params_predicted_peak'])}"
                if "gathered_params_predicted_peak" in state else "")
    _rank0_print(
        f"memory (rank 0, MiB): model states {mib(state['total'])} (weights "
        f"{mib(state['params'])}, gradients {mib(state['grads'])}, optimizer "
        f"{mib(state['main_params'] + state['optimizer_states'])}; {state['strategy']} at dp "
        f"{state['dp']}, ZeRO formula {mib(state['predicted_total'])}{host}{gathered}) + "
        + ("activations not measured (T5)" if config.model.is_encoder_decoder else
           f"activations {mib(act['activation_bytes_per_microbatch'])} per microbatch (the "
           f"decoder layers' {mib(act['activation_bytes_layers'])}, predicted "
           f"{mib(act['activation_bytes_layers_predicted'])})") +
        (f"; largest rank {largest}: {mib(totals[largest])}" if len(totals) > 1 else "") +
        "; details in metrics.jsonl")
    _rank0_print(line)
    return {**act, **{f"model_state_{k}" + ("" if k in _STATE_COUNTS else "_bytes"): v
                      for k, v in state.items()}, "memory_bytes_per_rank": totals, **planner}


_STATE_COUNTS = ("psi", "psi_padded", "dp", "strategy")  # model-state fields not in bytes


def log_activation_memory(chunks, dataset, config: Config, device) -> dict:
    """`chunks`: the DistributedDataParallel wrappers (ZeRO-3 gathers through them).
    Measure the activation bytes one microbatch saves for backward on this rank (RNG
    untouched) and return them beside the predictions: the total, the decoder layers' share,
    and the layers' model-specific and Korthikanti et al. predictions (training/memory.py)."""
    t = config.train
    if config.model.is_encoder_decoder:
        _rank0_print("note: activation memory is measured and predicted for decoder-only "
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
                               keyed_dropout=t.dropout_masks == "sample")
    return {"activation_bytes_per_microbatch": report["activation_bytes_per_microbatch"],
            "activation_bytes_layers": report["activation_bytes_layers"],
            "activation_bytes_layers_predicted": report["activation_bytes_layers_model_predicted"],
            "activation_bytes_layers_paper": report["activation_bytes_layers_paper_predicted"]}


def _validate(model, valid_ds, config: Config, device, logger, it: int,
              progress: Progress | None = None) -> dict:
    began = time.perf_counter()
    vloss = evaluate(model, valid_ds, config, device, EvalProgress(
        f"validation at iter {it}", config.train.eval_iters, enabled=dist.get_rank() == 0))
    if progress is not None:
        progress.other("valid", time.perf_counter() - began)
    rec = {"iteration": it, "valid_loss": vloss, "valid_ppl": math.exp(min(vloss, 50))}
    logger.log(rec, f"validation at iter {it}: loss {vloss:.4f} | ppl {rec['valid_ppl']:.2f}",
               prefix="valid")
    return rec
