"""`TrainConfig`: the training settings of a run (layout, batch, optimizer, data, checkpoints,
logging), one field per flag with Megatron's names and defaults.

Plain data, below both training/arguments.py (which makes every field a flag and reads them
into a `Config` beside the `ModelConfig`) and run_config/checks.py (which validates the
fields), so neither needs the other to name the type.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainConfig:
    """Parallel layout, batch, optimizer, data and logging settings (Megatron flag names).

    Iterations and batch sizes are counts of optimizer steps and of sequences; ``lr`` is the
    peak learning rate; ``ddp_bucket_size`` is in elements; ``peak_tflops`` is per device.
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    num_layers_per_virtual_pipeline_stage: int | None = None
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    pipeline_model_parallel_split_rank: int | None = None  # T5: first decoder stage
    sequence_parallel: bool = False
    pipeline_schedule: str | None = None  # 1f1b | interleaved | zb-h1 | zbv (None: by vpp)
    expert_model_parallel_size: int = 1  # EP: each MoE layer's experts split over DP ranks
    expert_tensor_parallel_size: int | None = None  # None: the TP size (the only one built)
    context_parallel_size: int = 1  # CP: each sequence split over ranks (ring attention)
    cp_comm_type: str = "p2p"  # CP attention's exchange: p2p (ring) | all_gather
    use_distributed_optimizer: bool = False  # ZeRO-1: Adam states/main weights sharded over DP
    data_parallel_sharding_strategy: str | None = None  # None: optim if the above, else no_shard
    optimizer_cpu_offload: bool = False  # main weights + Adam moments in host memory
    optimizer_offload_fraction: float | None = None  # None: 1.0 with --optimizer-cpu-offload
    optimizer_offload_device: str | None = None  # cpu | nvme (ZeRO-Infinity); cpu-offload = cpu
    param_offload_device: str | None = None  # cpu | nvme: ZeRO-3 parameter shards off device
    offload_path: str | None = None  # nvme: folder on the drive (per-run, per-rank scratch)
    offload_buffer_count: int = 2  # nvme: host buffers streaming the shards (>= 2)
    offload_buffer_size: int = 4_000_000  # nvme: elements per buffer (longer shards: pieces)
    offload_io_threads: int = 2  # nvme: threads doing the pread/pwrite of the scratch files
    offload_pin_memory: bool = True  # nvme/cpu on CUDA: page-locked host buffers
    recompute_granularity: str | None = None  # None | "full" | "selective"
    recompute_method: str | None = None  # full only: uniform (default) | block
    recompute_num_layers: int | None = None  # full only: group size / checkpointed layers (1)
    compile: bool = False  # torch.compile each transformer layer (layers/transformer.py)
    micro_batch_size: int = 1
    global_batch_size: int | None = None  # None: micro_batch_size * data_parallel_size
    train_iters: int = 1000
    lr: float = 3.0e-4
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None  # None: train_iters
    lr_decay_style: str = "cosine"  # cosine | linear | constant
    rampup_batch_size: list[str] | None = None  # START INCREMENT SAMPLES (Megatron's)
    train_samples: int | None = None  # replaces train_iters; the LR schedule counts samples
    lr_warmup_samples: int = 0  # with train_samples
    lr_decay_samples: int | None = None  # with train_samples; None: train_samples
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1.0e-8
    clip_grad: float = 1.0  # 0 disables gradient clipping
    seed: int = 1234
    dropout_masks: str = "sample"  # sample (layout-independent) | rank-streams (Megatron's)
    check_for_nan_in_loss_and_grad: bool = True  # skip a step whose loss/grad norm is not finite
    max_skipped_iters: int = 3  # consecutive skipped steps that stop the run (0: never stop)
    check_weight_hash_across_dp_replicas_interval: int | None = None  # replicas' weights equal?
    bf16: bool = False  # bf16 weights/activations; fp32 main weights, grads, Adam states
    fp8_format: str | None = None  # FP8 GEMMs in the layer linears: e4m3 | hybrid (None: off)
    fp8_recipe: str = "delayed"  # tensorwise | delayed | rowwise | blockwise | mxfp8
    fp8_margin: int = 0  # scale = fmax / amax / 2^margin
    fp8_amax_history_len: int = 1  # delayed: steps of amax history per tensor
    fp8_amax_compute_algo: str = "most_recent"  # delayed: max | most_recent of the history
    first_last_layers_bf16: bool = False  # keep the first/last layers out of FP8
    num_layers_at_start_in_bf16: int = 1  # ... this many first layers
    num_layers_at_end_in_bf16: int = 1  # ... and this many last layers
    data_path: list[str] | None = None  # [prefix] or [w1, prefix1, w2, prefix2, ...]
    split: str = "969,30,1"
    reset_position_ids: bool = False  # positions restart after every EOD in a sample
    reset_attention_mask: bool = False  # attention does not cross an EOD in a sample
    eod_mask_loss: bool = False  # no loss on predicting from an EOD input token
    tokenizer_model: str | None = None  # SentencePiece .model file or HF tokenizer folder
    vocab_extra_ids: int | None = None  # T5 sentinels on top of the tokenizer (None: 100 for t5)
    noise_density: float = 0.15  # T5 span corruption: share of tokens masked
    mean_noise_span_length: float = 3.0  # T5 span corruption: mean tokens per masked span
    eval_interval: int = 1000  # 0 disables evaluation
    eval_iters: int = 100
    log_interval: int = 10
    log_dir: str = "runs/latest"
    tensorboard: bool | None = None  # None: on when tensorboard is installed
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None  # None: save only at the end when --save is given
    keep_last: int | None = None  # keep the newest N complete checkpoints (None: all)
    save_replica: str | None = None  # also copy each completed checkpoint here
    async_save: bool = False  # write checkpoints in the background
    load_rng: bool = True  # --no-load-rng: keep the fresh seeds on resume
    load_optim: bool = True  # --no-load-optim: weights only (fresh AdamW moments)
    finetune: bool = False  # --load weights only; iteration, optimizer and RNG start fresh
    lora_rank: int = 0  # LoRA adapters of this rank on a frozen base (0: every weight trains)
    lora_alpha: float = 8.0  # adapter scale alpha / rank (peft's default alpha)
    lora_dropout: float = 0.0  # dropout on each adapter's input (keyed masks)
    lora_target_modules: str = "all-linear"  # q_proj,...,down_proj | linear_qkv,... | all-linear
    use_rslora: bool = False  # scale alpha / sqrt(rank) (rsLoRA)
    lora_base_quantization: str = "none"  # QLoRA: none | int8 | int4 | q8_0 | q4_0 | q4_1
    override_opt_param_scheduler: bool = False  # resume: this command line's LR schedule
    use_checkpoint_opt_param_scheduler: bool = False  # resume: the checkpoint's LR schedule
    override_data_config: bool = False  # resume onto other data: start it from its beginning
    exit_signal_handler: bool = False  # SIGTERM/SIGUSR1: finish the step, save, exit 0
    exit_duration_in_mins: float | None = None  # save and exit after this much wall time
    exit_interval: int | None = None  # save and exit after the iteration divisible by this
    ddp_bucket_size: int = 40_000_000
    overlap_grad_reduce: bool = True
    diloco_sync_every: int | None = None  # DiLoCo: outer step every H inner steps (None: off)
    diloco_outer_lr: float = 0.7  # DiLoCo's outer SGD step (Douillard et al. 2023: 0.7)
    diloco_outer_momentum: float = 0.9  # its Nesterov momentum (paper: 0.9)
    straggler_threshold: float | None = None  # warn when a rank's step is this x the median
    peak_tflops: float | None = None  # None: measured at start-up
    device: str = "auto"  # auto | cpu | cuda
    profile_pipeline: bool = False
    profile: bool = False  # torch.profiler over the steps below (training/profiling.py)
    profile_step_start: int = 10  # finished iterations when recording starts (Megatron's)
    profile_step_end: int = 12  # ... and when it stops: steps start+1..end are recorded
    profile_ranks: list[str] | None = None  # global ranks to profile; None: rank 0
    report_comm: bool = False  # count collectives of a step beside the planner's
    distributed_timeout_minutes: float = 10.0  # every process group's operation timeout
    collective_trace_size: int = 2000  # calls each rank keeps for the hang doctor; 0: off
    debug_collectives: bool = False  # ranks check they make the same call before each one
