"""The iterations of a run (Megatron's `train` and what it calls).

`train(run)` takes the `TrainState` that training/trainer.py's start-up built and runs the
iterations from the resumed one to --train-iters: `train_step` (one global batch: schedule,
gradient syncs, clipping, the optimizer step or a skip, then an MoE model's expert load and
bias update: training/expert_load.py), then the step's instrumentation
(--profile, --profile-pipeline, --report-comm), the skipped-step count, the replica check,
`training_log`, `evaluate_and_print_results`, `save_checkpoint_and_time` and the exit
checks, in that order. The start-up, the final save and the run's closing records stay in
training/trainer.py.
"""
from __future__ import annotations

import dataclasses
import math
import time

import torch
import torch.distributed as dist
from torch.profiler import record_function

import parallel_state as ps
from data_pipeline import batch_digest
from data_parallel.ddp import all_reduce_embedding_grads, all_reduce_sequence_parallel_grad_pieces
from data_parallel.distributed_optimizer import DistributedOptimizer
from data_parallel.fsdp import peak_gathered_bytes
from data_parallel.grad_norm import clip_grads
from layers.fp8 import clear_step_amaxes, update_amax_histories
from models.mtp import take_loss_sums
from parallel_state import collectives
from parallel_state.comm_counter import CommCounter
from parallel_state.p2p import TensorSpec
from planner.report import log_comm
from run_config.batch_schedule import BatchSchedule

from .arguments import Config
from .batches import get_microbatches
from .checkpointing import Checkpointer, DataPosition, kill_hook, signal_hook
from .diloco import DiLoCo
from .stragglers import StragglerReport, slow_down_for_test
from .expert_load import ExpertLoadLog
from .memory import peak_memory_bytes
from .metrics import EvalProgress, MetricsLogger, Progress, format_duration, validates_at
from .mfu import PeakFlops
from .nonfinite import (NonFiniteError, StepGuard, grads_outside_norm, inject_grad_for_test,
                        inject_loss_for_test)
from .optimizer import learning_rate
from .preemption import ExitCheck
from .profiling import StepProfiler
from .replicas import check_replicas
from .schedules import get_forward_backward_func
from .timeline import Timeline, gather_timeline


def print_rank_0(*args) -> None:
    """`print` on global rank 0 only (every rank before the process group exists)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def _global_sum(x: torch.Tensor, group) -> torch.Tensor:
    x = x.clone()
    if dist.get_world_size(group) > 1:
        collectives.all_reduce(x, group=group)
    return x


def pipeline_spec(config: Config, device) -> TensorSpec:
    """What adjacent stages exchange: hidden states `[s, b, h]` (`[s/tp, b, h]` under SP;
    a context-parallel rank's part `[s/cp, b, h]`, `[s/(cp tp), b, h]` under SP).

    T5 (Megatron's encoder-and-decoder pipeline): encoder stages pass the encoder hidden
    `[se, b, h]`; the first decoder stage receives the encoder output, and every decoder
    stage passes `(decoder hidden [sd, b, h], encoder output [se, b, h])`."""
    m, t = config.model, config.train
    sp = t.tensor_model_parallel_size if t.sequence_parallel else 1
    sp *= t.context_parallel_size  # T5 is refused at cp > 1 (run_config/checks.py)
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


def batch_group(config: Config):
    """The group a training step's loss and token counts sum over: dp x cp (the global
    batch), or under DiLoCo cp only (each replica trains on its own share: training/diloco.py)."""
    return ps.get_context_parallel_group() if config.train.diloco_sync_every else \
        ps.get_data_parallel_group(with_context_parallel=True)


def global_loss_sum(loss_sum: torch.Tensor, group=None) -> torch.Tensor:
    """Sum of token losses of the global batch, on every rank (the loss lives on the last
    pipeline stage of each DP replica); `group`: the data group summed over (default dp x cp)."""
    loss_sum = _global_sum(loss_sum, ps.get_pipeline_model_parallel_group())
    return _global_sum(loss_sum, group if group is not None else
                       ps.get_data_parallel_group(with_context_parallel=True))


def evaluate(chunks, dataset, config: Config, device, progress=None) -> float:
    """Mean token loss (nats) over `eval_iters` global batches of the validation split;
    `progress(batches done)`, if given, is called after each (metrics.EvalProgress)."""
    forward_backward = get_forward_backward_func(config.train.pipeline_schedule)
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
    return float(global_loss_sum(loss_sum) / _global_sum(
        tokens, ps.get_data_parallel_group(with_context_parallel=True)))


@dataclasses.dataclass
class TrainState:
    """What the start-up built for the iterations, and what they carry from one to the next
    (Megatron passes the same to `train` as arguments and globals)."""
    config: Config
    device: torch.device
    train_ds: object
    valid_ds: object | None
    chunks: list  # this rank's model chunks
    model: list  # their DistributedDataParallel wrappers
    optimizer: object  # AdamW or the DistributedOptimizer
    params: list  # the parameters that train
    forward_backward: object  # the schedule (training/schedules.py)
    spec: TensorSpec
    flops_per_token: float
    peak: PeakFlops
    start_iteration: int  # the checkpoint's iteration (0: from scratch)
    position: DataPosition
    batches: BatchSchedule
    checkpointer: Checkpointer | None
    logger: MetricsLogger
    is_logger: bool  # global rank 0
    run_start: float | None  # --exit-duration-in-mins counts from here
    records: list = dataclasses.field(default_factory=list)  # what pretrain returns
    profiles: list = dataclasses.field(default_factory=list)  # --profile-pipeline timelines
    # set by `train` before the first iteration
    progress: Progress | None = None
    start: float = 0.0  # time.time() at the first iteration
    profiler: StepProfiler | None = None
    guard: StepGuard | None = None
    counter: CommCounter | None = None  # --report-comm
    counted_step: int = 0  # the iteration --report-comm counts
    comm: dict | None = None  # --report-comm's record of the counted step
    moe: ExpertLoadLog | None = None  # the MoE layers' load and aux-loss weight
    diloco: DiLoCo | None = None  # --diloco-sync-every's outer optimizer
    counted_steps: int = 1  # steps --report-comm counts (DiLoCo: one sync period)
    window_counts: dict = dataclasses.field(default_factory=dict)  # their counts so far
    stragglers: StragglerReport | None = None  # per-rank phase times (world size > 1)


@dataclasses.dataclass
class StepResult:
    """One training step, as `train_step` leaves it (Megatron's returns loss, skipped, norm)."""
    global_batch_size: int
    lr: float
    data_start: int  # the data index of the batch's first sample
    loss: float  # mean token loss of the global batch, the same on every rank
    grad_norm: float
    skipped: str | None  # why the StepGuard skipped the optimizer step, else None
    timeline: Timeline | None  # --profile-pipeline
    counted: object | None  # --report-comm's counts, on the counted step
    data_s: float = 0.0  # seconds spent building the microbatches
    not_finite: str | None = None  # what was not finite (the same on every rank), else None
    mtp_losses: list = dataclasses.field(default_factory=list)  # per MTP depth, as `loss`


def train(run: TrainState) -> tuple[int, str | None]:
    """The iterations from the resumed one up to --train-iters (Megatron's `train`): each
    step, then its log, validation, save and the exit checks. Returns (the last iteration,
    why the run stopped early or None). Raises NonFiniteError after --max-skipped-iters
    skipped steps in a row (an earlier save still being written completes first) and
    ReplicaMismatchError from the replica check."""
    t = run.config.train
    evaluating = run.valid_ds is not None and bool(t.eval_interval)
    run.progress = Progress(t.train_iters, t.eval_interval if evaluating else 0,
                            t.save_interval, save_at_end=run.checkpointer is not None)
    if evaluating and run.start_iteration == 0:
        # the starting point, so a run shows how far validation loss fell
        run.records.append(evaluate_and_print_results(run, 0))
    for ddp in run.model:
        ddp.zero_grad_buffer()  # ZeRO-3: frees what the measurements above left gathered
    peak_gathered_bytes(reset=True)
    run.moe = ExpertLoadLog(run.chunks, run.config.model)  # forgets the measurements' routing
    take_loss_sums(run.chunks)  # and the MTP losses of the start-up's measuring forward
    print_rank_0(f"training iterations {run.start_iteration + 1}..{t.train_iters}; the first "
                 f"step also does one-time set-up (allocation, warm-up)")
    run.start = time.time()
    exit_check = ExitCheck(t, run.run_start or run.start)
    run.profiler = StepProfiler(t, t.log_dir, run.device)
    stop = None
    run.guard = StepGuard(t.check_for_nan_in_loss_and_grad, t.max_skipped_iters,
                          replica_local=run.diloco is not None)
    # --report-comm counts the second step (a steady one) when there is one, else the first
    run.counted_step = run.start_iteration + (1 if t.train_iters > run.start_iteration + 1
                                              else 0)
    run.counter = CommCounter() if t.report_comm else None
    run.stragglers = StragglerReport(t.straggler_threshold) if dist.get_world_size() > 1 \
        else None
    if run.diloco is not None:  # a whole period (one outer step), reported per step
        run.counted_steps = max(1, min(t.diloco_sync_every, t.train_iters - run.counted_step))
    try:
        for iteration in range(run.start_iteration, t.train_iters):
            run.profiler.before(iteration)
            step_start = time.perf_counter()
            if run.stragglers is not None:
                run.stragglers.begin_step(iteration)
            step = train_step(run, iteration)
            if run.stragglers is not None:
                run.stragglers.end_step(time.perf_counter() - step_start, step.data_s)
            _after_step(run, step, iteration, step_start)
            it = iteration + 1
            _handle_skipped_step(run, step, it)
            if t.check_weight_hash_across_dp_replicas_interval and \
                    it % t.check_weight_hash_across_dp_replicas_interval == 0:
                check_replicas(run.model, it)
            if step.skipped is None and (it % t.log_interval == 0 or it == t.train_iters
                                         or it == run.start_iteration + 1):
                training_log(run, step, it)
            if evaluating and validates_at(it, t.train_iters, t.eval_interval):
                run.records.append(evaluate_and_print_results(run, it))
            if run.checkpointer and t.save_interval and it % t.save_interval == 0 and \
                    step.skipped is None:  # a save never ends a streak of skipped steps
                save_checkpoint_and_time(run, it)
            kill_hook(it)  # test hook (training/checkpointing.py); no-op unless its env var is set
            stop = exit_check.reason(it)
            if stop is not None:
                break
    except NonFiniteError:
        if run.checkpointer:
            run.checkpointer.wait()  # an earlier, good save still being written completes
        raise
    finally:
        exit_check.close()
        if run.stragglers is not None:
            run.stragglers.close()
    return (it if stop is not None else max(run.start_iteration, t.train_iters)), stop


def train_step(run: TrainState, iteration: int) -> StepResult:
    """One global batch (Megatron's `train_step`): its microbatches forward and backward
    through the schedule, the gradient syncs (DP buckets, SP norms, tied embedding),
    clipping, and the optimizer step unless the StepGuard skips it; `consumed_samples`
    moves on by the batch either way. --report-comm's counter brackets the counted step."""
    t, position, optimizer = run.config.train, run.position, run.optimizer
    gbs = run.batches.size(position.consumed_samples)
    counting = run.counter is not None and \
        run.counted_step <= iteration < run.counted_step + run.counted_steps
    if counting:  # step by step: the logs, validations and saves between them are not counted
        run.counter.begin()
    if t.train_samples:  # the schedule counts samples, this step's included
        lr = learning_rate(position.consumed_samples + gbs - 1, lr=t.lr, min_lr=t.min_lr,
                           warmup_iters=t.lr_warmup_samples,
                           decay_iters=t.lr_decay_samples, style=t.lr_decay_style)
    else:
        lr = learning_rate(iteration, lr=t.lr, min_lr=t.min_lr,
                           warmup_iters=t.lr_warmup_iters,
                           decay_iters=t.lr_decay_iters or t.train_iters, style=t.lr_decay_style)
    for group in optimizer.param_groups:
        group["lr"] = lr
    data_start = position.data_index
    data_began = time.perf_counter()
    with record_function("shardzoo.data"):
        microbatches = get_microbatches(run.train_ds, data_start, run.config, run.device, gbs)
    data_s = time.perf_counter() - data_began
    signal_hook(iteration + 1)  # test hook; no-op unless its env var is set
    # the loss tokens of the whole global batch: each dp x cp rank holds a part of them
    num_tokens = _global_sum(sum(mb["loss_mask"].sum() for mb in microbatches),
                             batch_group(run.config))
    for ddp in run.model:
        ddp.zero_grad_buffer()
    run.moe.before_step(gbs, t.micro_batch_size)
    timeline = Timeline() if t.profile_pipeline and iteration > 0 else None
    hooks = inject_grad_for_test(iteration + 1, run.params)  # no-op unless testing
    delayed = t.fp8_format is not None and t.fp8_recipe == "delayed"
    if delayed:
        clear_step_amaxes(run.chunks)
    began = time.perf_counter()
    loss_sum = run.forward_backward(model=run.model, microbatches=microbatches,
                                    loss_scale=1.0 / float(num_tokens), spec=run.spec,
                                    timeline=timeline)
    slow_down_for_test(time.perf_counter() - began)  # no-op unless its env var is set
    for hook in hooks:
        hook.remove()
    for ddp in run.model:
        ddp.finish_grad_sync()
    if delayed:
        update_amax_histories(run.chunks)  # the step's amaxes, the same on every rank
    all_reduce_sequence_parallel_grad_pieces(run.model)
    all_reduce_embedding_grads(run.model)
    loss_sum = inject_loss_for_test(iteration + 1, loss_sum)
    with record_function("shardzoo.optimizer"):
        if isinstance(optimizer, DistributedOptimizer):
            grad_norm = optimizer.clip_grad_norm(t.clip_grad)
        else:
            grad_norm = clip_grads(run.params, t.clip_grad)
        # the same on every rank (DiLoCo: on every rank of the replica); with multi-token
        # prediction its depths' losses ride along (models/mtp.py)
        sums = torch.cat([loss_sum.reshape(1), mtp_loss_sums(run)])
        means = (global_loss_sum(sums, batch_group(run.config)) / num_tokens).tolist()
        loss, mtp_losses = means[0], means[1:]
        # agreed by every rank, also where the loss and norm are a replica's own (DiLoCo)
        not_finite = run.guard.not_finite(loss, grad_norm,
                                          grads_outside_norm(optimizer, run.params), loss_sum)
        skipped = run.guard.skip_reason(not_finite)
        if skipped is None:
            optimizer.step()
        if run.diloco is not None and run.diloco.due(iteration + 1, t.train_iters):
            run.diloco.sync()
    run.moe.after_step(applied=skipped is None)
    position.consumed_samples += gbs
    counted = None
    if counting:
        for key, (calls, nbytes) in run.counter.stop().items():
            total = run.window_counts.setdefault(key, [0, 0])
            total[0] += calls
            total[1] += nbytes
        if iteration == run.counted_step + run.counted_steps - 1:
            counted = {k: (c, b) for k, (c, b) in run.window_counts.items()}
    return StepResult(gbs, lr, data_start, loss, grad_norm, skipped, timeline, counted, data_s,
                      not_finite, mtp_losses)


def mtp_loss_sums(run: TrainState) -> torch.Tensor:
    """`[D]` float32: this rank's masked loss sums of the multi-token-prediction depths over
    the step (zeros on a stage without them; empty for a model without MTP)."""
    depths = run.config.model.mtp_num_layers or 0
    sums = take_loss_sums(run.chunks) if depths else None
    if sums is None:
        return torch.zeros(depths, device=run.device)
    return sums.to(device=run.device, dtype=torch.float32)


def _after_step(run: TrainState, step: StepResult, iteration: int, step_start: float) -> None:
    """The step's instrumentation, in this order: --profile's window, the step's time,
    then (outside it: not the step's time or traffic) --profile-pipeline's timeline gather
    and --report-comm's counts."""
    profile = run.profiler.after(iteration, run.logger)
    if profile is not None:
        run.records.append(profile)
    run.progress.step(time.perf_counter() - step_start)
    if step.timeline is not None:
        run.profiles.append(gather_timeline(step.timeline))
    if step.counted is not None:
        run.comm = log_comm(run.config, step.counted, step.global_batch_size, iteration + 1,
                            run.logger, steps=run.counted_steps, first_step=(
                                iteration + 1 - run.counted_steps == run.start_iteration))
        run.records.append(run.comm)
        if run.counted_steps > 1:
            print_rank_0("(DiLoCo: the counts above are totals over one outer step; the "
                         "planner's column is synchronous data parallelism's, times the steps)")


def _handle_skipped_step(run: TrainState, step: StepResult, it: int) -> None:
    """Log a skipped step and stop the run (NonFiniteError, nothing saved) after
    --max-skipped-iters in a row."""
    t = run.config.train
    in_a_row = run.guard.record(step.skipped)
    if step.skipped is not None:
        rec = {"iteration": it, "event": "skipped", "reason": step.skipped, "loss": step.loss,
               "grad_norm": step.grad_norm, "consecutive": in_a_row}
        limit = f" of {t.max_skipped_iters} allowed" if t.max_skipped_iters else ""
        run.logger.log(rec, f"iter {it:6d}/{t.train_iters} | step skipped: {step.skipped} "
                            f"(weights and optimizer unchanged; {in_a_row} in a "
                            f"row{limit})", prefix="skip")
        run.records.append(rec)
    run.guard.stop_if_needed(it, step.skipped, step.not_finite)


def training_log(run: TrainState, step: StepResult, it: int) -> None:
    """The iteration's log line and metrics record (Megatron's `training_log`): loss, LR,
    gradient norm, tokens/s, TFLOP/s per device and MFU over the training steps since the
    previous line, peak memory, elapsed time and ETA, the data position, and an MoE model's
    expert load since the previous line (training/expert_load.py)."""
    t, m, gbs, loss = run.config.train, run.config.model, step.global_batch_size, step.loss
    if run.diloco is not None and run.diloco.dp > 1:  # the replicas' mean (equal token counts)
        loss = float(_global_sum(torch.tensor(loss, device=run.device),
                                 run.diloco.group)) / run.diloco.dp
    step_time = run.progress.window()  # training steps only: no validation or saving
    tps = gbs * m.seq_length / step_time  # this step's batch (ramp-up)
    tflops = run.flops_per_token * tps / dist.get_world_size() / 1e12
    mfu = run.peak.mfu(tflops) if run.is_logger else None
    eta = run.progress.eta(it)
    rec = {"iteration": it, "loss": loss, "lr": step.lr, "grad_norm": step.grad_norm,
           "tokens_per_s": tps, "tflops": tflops, "mfu": mfu,
           "memory": peak_memory_bytes(run.device), "step_time_s": step_time,
           **({"gathered_params_peak_bytes": peak_gathered_bytes()}
              if t.data_parallel_sharding_strategy == "optim_grads_params" else {}),
           "elapsed_s": time.time() - run.start, "eta_s": eta,
           "consumed_samples": run.position.consumed_samples,
           "global_batch_size": gbs,
           "samples_digest": batch_digest(run.train_ds, step.data_start, gbs)}
    mtp = "".join(f"mtp_{k} loss {v:.4f} | " for k, v in enumerate(step.mtp_losses, 1))
    rec.update({f"mtp_{k}_loss": v for k, v in enumerate(step.mtp_losses, 1)})
    moe, moe_line = run.moe.report()  # collective over the pipeline stages
    rec.update(moe)
    if run.is_logger:
        run.peak.say_note()
    run.logger.log(rec, f"iter {it:6d}/{t.train_iters} | loss {loss:.4f} | {mtp}lr {step.lr:.3e} | "
                        f"grad norm {step.grad_norm:.3f} | {tps:,.0f} tok/s | "
                        f"{tflops:.3f} TFLOP/s/dev | mfu "
                        f"{'n/a' if mfu is None else f'{mfu:.1%}'} | "
                        f"mem {rec['memory'] / 2**20:,.0f} MiB | "
                        f"elapsed {format_duration(rec['elapsed_s'])} | "
                        f"eta {format_duration(eta)}" + (f" | {moe_line}" if moe_line else ""))
    run.records.append(rec)
    if run.stragglers is not None:  # collective over the world, like the MoE report above
        report = run.stragglers.report(it, run.logger)
        if report is not None:
            run.records.append(report)


def evaluate_and_print_results(run: TrainState, it: int) -> dict:
    """Validation at iteration `it` (Megatron's name): the loss over --eval-iters batches and
    its perplexity, logged; returns the record. Its time counts toward the ETA, not the
    steps."""
    began = time.perf_counter()
    vloss = evaluate(run.model, run.valid_ds, run.config, run.device, EvalProgress(
        f"validation at iter {it}", run.config.train.eval_iters, enabled=dist.get_rank() == 0))
    run.progress.other("valid", time.perf_counter() - began)
    rec = {"iteration": it, "valid_loss": vloss, "valid_ppl": math.exp(min(vloss, 50))}
    run.logger.log(rec, f"validation at iter {it}: loss {vloss:.4f} | ppl {rec['valid_ppl']:.2f}",
                   prefix="valid")
    return rec


def save_checkpoint_and_time(run: TrainState, it: int) -> None:
    """Save iteration `it` (Megatron's name); its time counts toward the ETA, not the steps."""
    save_start = time.perf_counter()
    run.checkpointer.save(it, run.chunks, run.model, run.optimizer, run.position)
    run.progress.other("save", time.perf_counter() - save_start)
