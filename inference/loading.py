"""Build this rank's sharded model and the tokenizer from a native checkpoint (`--load`) or a
Hugging Face folder / .gguf file (`--hf`, converted in memory), with the model's generation
config (`model.generation_config`; its stop ids: models.hf.generation.eos_token_ids)."""
from __future__ import annotations

import os

import torch

import parallel_state as ps
from layers import parameters_on_meta
from layers.quantized import Quantization
from models import GPTModel, T5Model
from models.config import ConfigError, ModelConfig
from models.hf.generation import generation_config
from models.pipeline import build_model_chunks

from .low_bit import LowBitPlan, check_low_bit_layout, weight_bytes_line
from models.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def stage_layers(num_layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage: as even as possible, the first stages take the remainder."""
    if num_layers < pp:
        raise ValueError(f"--pp {pp} is larger than the model's {num_layers} layers")
    return [num_layers // pp + (s < num_layers % pp) for s in range(pp)]


def t5_stage_layers(config: ModelConfig, pp: int) -> list[tuple[list[int], list[int]]]:
    """`(encoder layers, decoder layers)` of each stage of a T5 pipeline for inference: the
    encoder on the first `max(1, pp // 2)` stages, the decoder on the rest, each as even as
    possible (`stage_layers`). pp = 1: everything on the one stage."""
    if pp == 1:
        return [(list(range(config.encoder_num_layers)), list(range(config.decoder_num_layers)))]
    split = max(1, pp // 2)
    out = []
    for n, stages in ((config.encoder_num_layers, split), (config.decoder_num_layers, pp - split)):
        sizes, start, runs = stage_layers(n, stages), 0, []
        for k in sizes:
            runs.append(list(range(start, start + k)))
            start += k
        out.append(runs)
    return [(e, []) for e in out[0]] + [([], d) for d in out[1]]


def _tp_error(config: ModelConfig, tp: int) -> ConfigError | None:
    """The `ConfigError` of splitting the model over `tp` ranks, None when it splits."""
    try:
        config.validate(tp) if config.is_encoder_decoder else \
            config.validate(tp, kv_replication=True)
    except ConfigError as e:
        return e
    return None


def _check_tp(config: ModelConfig, tp: int) -> None:
    """Raise a `ConfigError` in infer.py's terms when the model cannot be split over `tp`
    ranks (heads, KV heads or FFN width not divisible), naming the tp values that work."""
    error = _tp_error(config, tp)
    if error is None:
        return
    good = [t for t in range(1, config.num_attention_heads + 1)
            if _tp_error(config, t) is None]
    if not good:  # the config itself is bad, whatever the tp
        raise error
    raise ConfigError(f"--tp {tp} does not fit this model ({config.num_attention_heads} "
                      f"attention heads, {config.num_query_groups} KV heads; in the config's "
                      f"terms: {error}); use --tp {', '.join(map(str, good))}")


def available_memory(device: torch.device) -> tuple[int, str]:
    """`(bytes, what)`: memory one rank may still allocate on `device`: CUDA's free memory,
    or the host's MemAvailable (/proc/meminfo) shared by the ranks on it (torchrun's
    LOCAL_WORLD_SIZE)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"free on {device}"
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 2**63, "not known"
    return kib * 1024 // ranks, f"of the host's {kib * 1024 / 2**30:.1f} GiB available, " \
        f"shared by its {ranks} rank(s)"


def initialize_serving_grid(tp: int, pp: int, enable_expert_parallel: bool = False) -> None:
    """The grid of infer.py: tp x pp ranks per replica, replicas over the rest of the world.
    `enable_expert_parallel` (vLLM's flag): an MoE layer's experts are spread whole over the
    tp ranks of a replica (expert parallel size tp, expert TP 1; layers/moe/moe_layer.py)
    rather than each expert split over them. Raises `parallel_state.GridError`."""
    ps.initialize_model_parallel(
        tp, pp, expert_model_parallel_size=tp if enable_expert_parallel else 1,
        expert_tensor_parallel_size=1 if enable_expert_parallel else None)


def _check_experts(config: ModelConfig, ep: int) -> None:
    """Refuse (`ConfigError`) --enable-expert-parallel when the model's experts do not
    spread evenly over the `ep` (= tp) ranks, naming the tp values the experts and the
    attention heads both split over."""
    experts = config.num_moe_experts
    if ep > 1 and experts and experts % ep:
        fits = [t for t in range(2, experts + 1)
                if experts % t == 0 and _tp_error(config, t) is None]
        raise ConfigError(f"--enable-expert-parallel spreads the model's {experts} experts "
                          f"over the --tp {ep} ranks, but {experts} is not divisible by {ep}; "
                          f"{f'use a --tp in {fits} or ' if fits else ''}drop "
                          f"--enable-expert-parallel (each expert "
                          f"is then split over the tp ranks)")


def _check_memory(config: ModelConfig, tp: int, pp: int, saved: int = 0) -> None:
    """Refuse (`ConfigError`) a model whose float32 weights on this rank (its 1 / (tp x pp)
    share of `num_parameters`, less the `saved` bytes its low-bit weights spare: `LowBitPlan`)
    exceed the memory it may allocate (`available_memory`), before anything is built."""
    need = (4 * config.num_parameters() - saved) // (tp * pp)
    have, what = available_memory(ps.get_device())
    if need > have:
        raise ConfigError(
            f"the model ({config.num_parameters():,} parameters) needs about "
            f"{need / 2**20:,.1f} MiB of {'float32' if not saved else 'low-bit and float'} "
            f"weights on each of the tp x pp = {tp * pp} "
            f"ranks, more than the {have / 2**20:,.1f} MiB this rank has ({what}); raise --tp "
            f"or --pp, or run on more hosts")


def build_model(config: ModelConfig, low_bit: "LowBitPlan | None" = None) -> GPTModel:
    """This rank's `GPTModel` stage on the current grid (KV heads replicated when tp >
    num_query_groups), or a `T5Model` stage (`t5_stage_layers`), weights uninitialized.
    With a `low_bit` plan that quantizes anything, the parameters are built on the meta
    device (`layers.parameters_on_meta`): the loader makes each as it fills it, and a
    quantized one never exists in float. Raises `models.config.ConfigError` (a tp the heads
    do not split over names the ones they do; experts that do not spread over the
    expert-parallel ranks; weights larger than the memory this rank has, `_check_memory`)."""
    _check_tp(config, ps.get_tensor_model_parallel_world_size())
    _check_experts(config, ps.get_expert_model_parallel_world_size())
    pp = ps.get_pipeline_model_parallel_world_size()
    _check_memory(config, ps.get_tensor_model_parallel_world_size(), pp,
                  low_bit.saved_bytes() if low_bit else 0)
    if low_bit is not None and low_bit.weights:
        with parameters_on_meta():
            return _build(config, pp)
    return _build(config, pp)


def _build(config: ModelConfig, pp: int):
    if config.is_encoder_decoder:  # T5: the encoder on the first pp // 2 stages
        enc, dec = t5_stage_layers(config, pp)[ps.get_pipeline_model_parallel_rank()]
        with torch.device(ps.get_device()):
            return T5Model(config, encoder_layer_numbers=enc, decoder_layer_numbers=dec)
    with torch.device(ps.get_device()):
        return build_model_chunks(GPTModel, config, stage_layers(config.num_layers, pp),
                                  ps.get_pipeline_model_parallel_rank(), None,
                                  kv_replication=True)[0]


def load(load: str | None = None, hf=None, tokenizer: str | None = None,
         dtype: str = "float32", log=None, quantization: Quantization | None = None
         ) -> tuple[GPTModel, Tokenizer | None, str]:
    """`(model stage, tokenizer or None, model name)` on the current grid; the model's
    `generation_config` attribute holds its checked generation config (models/hf/generation.py;
    `{}` for a checkpoint without one).

    Exactly one of `load` (native checkpoint folder, or its parent with a `latest` marker) and
    `hf` (HF folder or .gguf file, or an opened `models.hf.files.HFSource`). `tokenizer`
    overrides the one stored with the model. `log`, if given (one rank's), is told each step
    and how far the weights are (the same lines as tools/convert_hf.py's:
    `models.hf.open_checked`, `checkpoint.hf.load_hf_weights`), then the weight bytes on
    this rank (`low_bit.weight_bytes_line`). `quantization` (layers/quantized.py, infer.py
    `--quantization`): low-bit weights as the file holds them, de-quantized ("none"), or
    float linear weights quantized on load ("int8", "int4"; `--hf` models only); a tp that
    would cut a quantization block is refused before anything is built
    (`low_bit.check_low_bit_layout`). Raises `ValueError`, `FileNotFoundError`, `checkpoint.format.CheckpointError` or
    `models.hf.HFConversionError` naming the problem.
    """
    if (load is None) == (hf is None):
        raise ValueError("pass exactly one of --load CKPT (native checkpoint) and --hf PATH "
                         "(Hugging Face folder or .gguf file)")
    if load is not None:
        from checkpoint.format import read_metadata, require_checkpoint
        from checkpoint.model_io import (find_tokenizer, load_model_weights,
                                         stored_generation_config)

        if quantization is not None and quantization.quantizes:
            raise ValueError(f"--quantization {quantization.method} quantizes a Hugging Face "
                             f"model's weights as they load (--hf); a native checkpoint "
                             f"(--load) is served in float: drop --quantization")
        path = require_checkpoint(load)
        config = ModelConfig.from_dict(read_metadata(path)["model"])
        generation = stored_generation_config(path, config.vocab_size)
        model = build_model(config)
        if log is not None:
            log(f"loading checkpoint {path}: {config.describe()}; checking and reading its "
                f"files")
        load_model_weights(path, [model])
        tok_path = tokenizer or find_tokenizer(path)
        if log is not None and tok_path:
            log(f"loading the tokenizer {tok_path}")
        tok = Tokenizer(tok_path) if tok_path else None
        name = os.path.basename(os.path.normpath(load))
    else:
        from checkpoint.hf import load_hf_weights
        from models.hf import open_checked

        quantization = quantization or Quantization()
        # a GGUF file's blocks and a GPTQ/AWQ folder's int4 layers are read as stored unless
        # --quantization none de-quantizes them (int8/int4 over them is refused below)
        src, config = open_checked(hf, lambda c: _check_tp(
            c, ps.get_tensor_model_parallel_world_size()), log,
            "none" if quantization.method == "none" else "keep")
        if config.is_encoder_decoder and quantization.quantizes:
            raise ValueError(f"--quantization {quantization.method} is for decoder-only "
                             f"models; serve this encoder-decoder model without it")
        generation = generation_config(src, config.vocab_size)
        low_bit = LowBitPlan.of(config, src, quantization)
        check_low_bit_layout(low_bit, [t for t in range(1, config.num_attention_heads + 1)
                                       if _tp_error(config, t) is None])
        model = build_model(config, low_bit)
        if log is not None:
            log(f"copying the weights into this rank's share (tp "
                f"{ps.get_tensor_model_parallel_world_size()}, pp "
                f"{ps.get_pipeline_model_parallel_world_size()}" +
                (f"; {len(low_bit.weights)} weights low-bit: {quantization.describe()}"
                 if low_bit.weights else "") + ")")
        load_hf_weights(src, config, [model], log, quantization)
        if log is not None:
            log(f"loading the tokenizer {tokenizer or 'of ' + src.path}")
        if tokenizer:
            tok = Tokenizer(tokenizer)
        else:
            from models.hf.tokenizer_files import TokenizerFileError

            where, kw = src.tokenizer_source()
            try:
                tok = Tokenizer(where, **kw)
            except TokenizerFileError:
                raise  # a file of it is refused (not: no tokenizer there)
            except ValueError:
                tok = None
        name = os.path.basename(os.path.normpath(src.path))
        if name.endswith(".gguf"):
            name = name[:-5]
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    model.generation_config = generation
    model = model.to(DTYPES[dtype]).eval()
    if log is not None:
        log(weight_bytes_line(model))
    return model, tok, name
