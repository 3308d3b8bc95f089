"""Training throughput (tokens/s) and MFU of shardzoo's GPTModel against Hugging Face
transformers on the same architecture, measured in the same run.

Peers: `GPT2LMHeadModel` (GPT-2 family) and `LlamaForCausalLM` (Llama family), built from a
config with the same shapes, `attn_implementation="sdpa"`, dropout 0; our weights are copied
into the HF twin so both compute the same function (the float32 losses are printed side by side
as a sanity check). One training step is: forward on the same `[b, s]` batch with next-token
labels, mean loss over tokens, backward, AdamW step, zero grad. Measurement rounds alternate
ours / HF (ABAB...) to cancel drift on a shared machine; tokens/s is the median over rounds.

Variants (`--dtypes`):
- `fp32`: float32 weights and compute, both models.
- `bf16`: float32 weights, compute under `torch.autocast(device, torch.bfloat16)`, both models.
- `bf16-main`: ours as train.py --bf16 runs it (bf16 weights, float32 main weights and AdamW
  state in `data_parallel.distributed_optimizer.DistributedOptimizer`, float32 gradient buffer of
  `data_parallel.ddp.DistributedDataParallel`), against HF under autocast (the `bf16`
  row's HF figure: transformers' own mixed precision).
- `compile`: fp32 with every transformer layer compiled (`torch.compile` per layer, as
  train.py --compile does), both models.

MFU = tokens/s x `planner.flops.training_flops_per_token(config)` / peak FLOP/s. The peak is
`training.mfu.PeakFlops`, the trainer's: the data sheet on known GPUs, else measured once at
the start (on a CPU, one thread's best matmul in CPU time x the threads, so a busy machine
does not lower it); an MFU above 100% is never printed ("n/a" and why).

Run: `python bench/train_throughput.py` (defaults take ~3 minutes on 2 CPU cores); see
`--help` and bench/README.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from data_parallel.ddp import DistributedDataParallel  # noqa: E402
from data_parallel.distributed_optimizer import DistributedOptimizer  # noqa: E402
from layers import compile_transformer_layers  # noqa: E402
from models import GPTModel, ModelConfig  # noqa: E402
from parallel_state.host_memory import ENV_SWITCH as HOST_SWITCH  # noqa: E402
from parallel_state.host_memory import tune_host_allocator  # noqa: E402
from planner.flops import training_flops_per_token  # noqa: E402
from training.mfu import PeakFlops  # noqa: E402

NOISY_SPREAD = 0.25  # (max - min) / median of per-round tokens/s above which a row is flagged
VARIANTS = ("fp32", "bf16", "bf16-main", "compile")
TARGET = 1.3  # the goal: ours >= 1.3x transformers in every row


# ---------------------------------------------------------------------------- configs
def family_of(config: ModelConfig) -> str:
    """"llama" for RoPE/RMSNorm/SwiGLU configs, "gpt" for learned-position/LayerNorm/GeLU."""
    return "llama" if config.activation == "swiglu" else "gpt"


def default_config(family: str, args) -> ModelConfig:
    h = args.hidden_size or 256
    common = dict(num_layers=args.num_layers or 4, hidden_size=h,
                  num_attention_heads=args.num_attention_heads or 8,
                  seq_length=args.seq_length or 256, vocab_size=args.vocab_size or 8192,
                  hidden_dropout=0.0, attention_dropout=0.0)
    if family == "gpt":
        return ModelConfig(**common, position_embedding_type="learned_absolute",
                           normalization="LayerNorm", activation="gelu", add_bias_linear=True,
                           untie_embeddings_and_output_weights=False, name="gpt-bench")
    if family == "llama":
        return ModelConfig(**common, num_query_groups=args.num_query_groups or 2,
                           ffn_hidden_size=args.ffn_hidden_size or (688 * h) // 256,
                           position_embedding_type="rope", normalization="RMSNorm",
                           activation="swiglu", add_bias_linear=False,
                           untie_embeddings_and_output_weights=True, name="llama-bench")
    raise SystemExit(f"--families: unknown family {family!r}; use gpt and/or llama")


def named_config(name: str, args) -> ModelConfig:
    """A config from configs/models/NAME.yaml, with any shape flag given overriding it."""
    import yaml

    path = ROOT / "configs" / "models" / f"{name}.yaml"
    if not path.exists():
        names = sorted(p.stem for p in path.parent.glob("*.yaml")) if path.parent.exists() else []
        raise SystemExit(f"--model {name}: no {path}; available: {names}")
    d = yaml.safe_load(path.read_text()) or {}
    for flag in ("hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
                 "ffn_hidden_size", "seq_length", "vocab_size"):
        if getattr(args, flag) is not None:
            d[flag] = getattr(args, flag)
    d.update(hidden_dropout=0.0, attention_dropout=0.0, name=name)
    if d.get("max_position_embeddings", 0) and d["max_position_embeddings"] < d["seq_length"]:
        d["max_position_embeddings"] = d["seq_length"]
    return ModelConfig.from_dict(d)


# ---------------------------------------------------------------------------- HF twin
def build_hf(config: ModelConfig):
    """The HF model with `config`'s shapes, sdpa attention, no dropout, float32."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if family_of(config) == "gpt":
        if config.num_query_groups != config.num_attention_heads or not config.add_bias_linear:
            raise SystemExit("GPT2LMHeadModel has multi-head attention with biases; this "
                             "config is not a GPT-2 (use a llama-style config)")
        hf_config = GPT2Config(
            vocab_size=config.vocab_size, n_positions=config.max_position_embeddings,
            n_embd=config.hidden_size, n_layer=config.num_layers,
            n_head=config.num_attention_heads, n_inner=config.ffn_hidden_size,
            activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            layer_norm_epsilon=config.layernorm_epsilon, use_cache=False,
            bos_token_id=None, eos_token_id=None,
            tie_word_embeddings=not config.untie_embeddings_and_output_weights)
        cls = GPT2LMHeadModel
    else:
        hf_config = LlamaConfig(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.ffn_hidden_size, num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_query_groups, head_dim=config.kv_channels,
            max_position_embeddings=config.max_position_embeddings,
            rope_theta=config.rotary_base, rms_norm_eps=config.layernorm_epsilon,
            tie_word_embeddings=not config.untie_embeddings_and_output_weights,
            attention_bias=False, mlp_bias=False, attention_dropout=0.0, use_cache=False,
            bos_token_id=None, eos_token_id=None)
        cls = LlamaForCausalLM
    hf_config._attn_implementation = "sdpa"
    model = cls(hf_config)
    if model.config._attn_implementation != "sdpa":
        raise RuntimeError(f"HF model runs {model.config._attn_implementation!r}, not sdpa")
    return model.float()


def _split_qkv(w: torch.Tensor, config: ModelConfig):
    """Our fused QKV rows `[q heads of g, k_g, v_g]` per KV group -> dense (q, k, v)."""
    g, d = config.num_query_groups, config.kv_channels
    per_group = config.num_attention_heads // g
    w = w.reshape(g, per_group + 2, d, *w.shape[1:])
    return (w[:, :per_group].reshape(g * per_group * d, *w.shape[3:]),
            w[:, per_group].reshape(g * d, *w.shape[3:]),
            w[:, per_group + 1].reshape(g * d, *w.shape[3:]))


@torch.no_grad()
def copy_weights_to_hf(ours: GPTModel, hf, config: ModelConfig) -> None:
    """Load our (tp=1) weights into the HF twin so both compute the same function."""
    p = dict(ours.named_parameters())
    v = config.vocab_size
    sd = {}
    if family_of(config) == "gpt":
        sd["transformer.wte.weight"] = p["embedding.word_embeddings.weight"][:v]
        sd["transformer.wpe.weight"] = p["embedding.position_embeddings.weight"]
        for i in range(config.num_layers):
            o, t = f"decoder.layers.{i}.", f"transformer.h.{i}."
            for ours_norm, hf_norm in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
                sd[t + hf_norm + ".weight"] = p[o + ours_norm + ".weight"]
                sd[t + hf_norm + ".bias"] = p[o + ours_norm + ".bias"]
            qkv_w = _split_qkv(p[o + "self_attention.linear_qkv.weight"], config)
            qkv_b = _split_qkv(p[o + "self_attention.linear_qkv.bias"], config)
            sd[t + "attn.c_attn.weight"] = torch.cat(qkv_w).t()  # Conv1D stores [in, out]
            sd[t + "attn.c_attn.bias"] = torch.cat(qkv_b)
            sd[t + "attn.c_proj.weight"] = p[o + "self_attention.linear_proj.weight"].t()
            sd[t + "attn.c_proj.bias"] = p[o + "self_attention.linear_proj.bias"]
            sd[t + "mlp.c_fc.weight"] = p[o + "mlp.linear_fc1.weight"].t()
            sd[t + "mlp.c_fc.bias"] = p[o + "mlp.linear_fc1.bias"]
            sd[t + "mlp.c_proj.weight"] = p[o + "mlp.linear_fc2.weight"].t()
            sd[t + "mlp.c_proj.bias"] = p[o + "mlp.linear_fc2.bias"]
        sd["transformer.ln_f.weight"] = p["decoder.final_layernorm.weight"]
        sd["transformer.ln_f.bias"] = p["decoder.final_layernorm.bias"]
    else:
        ffn = config.ffn_hidden_size
        sd["model.embed_tokens.weight"] = p["embedding.word_embeddings.weight"][:v]
        for i in range(config.num_layers):
            o, t = f"decoder.layers.{i}.", f"model.layers.{i}."
            sd[t + "input_layernorm.weight"] = p[o + "input_layernorm.weight"]
            sd[t + "post_attention_layernorm.weight"] = p[o + "pre_mlp_layernorm.weight"]
            q, k, vv = _split_qkv(p[o + "self_attention.linear_qkv.weight"], config)
            sd[t + "self_attn.q_proj.weight"] = q
            sd[t + "self_attn.k_proj.weight"] = k
            sd[t + "self_attn.v_proj.weight"] = vv
            sd[t + "self_attn.o_proj.weight"] = p[o + "self_attention.linear_proj.weight"]
            fc1 = p[o + "mlp.linear_fc1.weight"]
            sd[t + "mlp.gate_proj.weight"] = fc1[:ffn]
            sd[t + "mlp.up_proj.weight"] = fc1[ffn:]
            sd[t + "mlp.down_proj.weight"] = p[o + "mlp.linear_fc2.weight"]
        sd["model.norm.weight"] = p["decoder.final_layernorm.weight"]
    if config.untie_embeddings_and_output_weights:
        sd["lm_head.weight"] = p["output_layer.weight"][:v]
    hf_params = dict(hf.named_parameters())  # tied lm_head appears once, as the embedding
    missing = sorted(set(hf_params) - set(sd))
    unknown = sorted(set(sd) - set(hf_params))
    if missing or unknown:
        raise RuntimeError(f"weight map incomplete: HF params not set {missing}, "
                           f"unknown names {unknown}")
    for name, tensor in sd.items():
        if hf_params[name].shape != tensor.shape:
            raise RuntimeError(f"{name}: HF shape {tuple(hf_params[name].shape)} != "
                               f"ours {tuple(tensor.shape)}")
        hf_params[name].copy_(tensor)


# ---------------------------------------------------------------------------- steps
def make_loss_fns(ours: GPTModel, hf):
    """`fn(ids, targets) -> scalar mean loss` for both; `targets[:, i]` follows `ids[:, i]`."""
    def ours_loss(ids, targets):
        return ours(ids, labels=targets).mean()

    def hf_loss(ids, targets):
        # `shift_labels` = already-shifted targets, so HF scores the same b*s tokens as ours.
        return hf(input_ids=ids, labels=targets, shift_labels=targets, use_cache=False).loss

    return ours_loss, hf_loss


class Trainer:
    """One model + AdamW; `step(n)` runs n training steps and returns seconds elapsed."""

    def __init__(self, model, loss_fn, batch, autocast_ctx, device):
        self.model, self.loss_fn, self.batch = model, loss_fn, batch
        self.autocast_ctx, self.device = autocast_ctx, device
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        self.last_loss = float("nan")

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _one_step(self, ids, targets):
        with self.autocast_ctx():
            loss = self.loss_fn(ids, targets)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def step(self, n: int) -> float:
        ids, targets = self.batch
        self._sync()
        start = time.perf_counter()
        for _ in range(n):
            loss = self._one_step(ids, targets)
        self._sync()
        elapsed = time.perf_counter() - start
        if n:
            self.last_loss = loss.item()
        return elapsed


class MainWeightsTrainer(Trainer):
    """train.py --bf16's step for our model: bf16 weights in the DDP wrapper's float32
    gradient buffer, float32 main weights and AdamW in the (unsharded) DistributedOptimizer."""

    def __init__(self, model, loss_fn, batch, device):
        self.model, self.loss_fn, self.batch = model, loss_fn, batch
        self.autocast_ctx, self.device = nullcontext, device
        self.ddp = DistributedDataParallel(model.to(torch.bfloat16))
        self.opt = DistributedOptimizer([self.ddp], lr=1e-4, weight_decay=0.01, shard=False)
        self.last_loss = float("nan")

    def _one_step(self, ids, targets):
        self.ddp.zero_grad_buffer()
        loss = self.loss_fn(ids, targets)
        loss.backward()
        self.ddp.finish_grad_sync()
        self.opt.step()
        return loss


# ---------------------------------------------------------------------------- bench
def sanity_check(config: ModelConfig, seed: int, batch, device) -> tuple[float, float]:
    """float32 losses of ours and the HF twin (our weights) on `batch`, before training."""
    ours = GPTModel(config).to(device)
    ours.init_weights(seed)
    hf = build_hf(config).to(device)
    copy_weights_to_hf(ours, hf, config)
    ours_loss, hf_loss = make_loss_fns(ours, hf)
    with torch.no_grad():
        return ours_loss(*batch).item(), hf_loss(*batch).item()


def compile_hf_layers(hf) -> None:
    """torch.compile each decoder layer of the HF model, as ours are compiled."""
    blocks = hf.transformer.h if hasattr(hf, "transformer") else hf.model.layers
    for block in blocks:
        block.compile()


def bench_one(config: ModelConfig, variant: str, args, batch, device, flops_per_token):
    ours = GPTModel(config).to(device)
    ours.init_weights(args.seed)
    hf = build_hf(config).to(device)
    copy_weights_to_hf(ours, hf, config)
    ours.train(), hf.train()
    if variant in ("bf16", "bf16-main"):
        def autocast_ctx():
            return torch.autocast(device.type, dtype=torch.bfloat16)
    else:
        autocast_ctx = nullcontext
    if variant == "compile":
        compile_transformer_layers(ours)
        compile_hf_layers(hf)
    ours_loss, hf_loss = make_loss_fns(ours, hf)
    if variant == "bf16-main":
        ours_trainer = MainWeightsTrainer(ours, ours_loss, batch, device)
    else:
        ours_trainer = Trainer(ours, ours_loss, batch, autocast_ctx, device)
    trainers = {"ours": ours_trainer, "hf": Trainer(hf, hf_loss, batch, autocast_ctx, device)}
    for t in trainers.values():
        t.step(args.warmup)
    tokens = args.steps * batch[0].numel()
    rates = {"ours": [], "hf": []}
    for _ in range(args.rounds):  # ABAB: alternate to cancel drift
        for name in ("ours", "hf"):
            rates[name].append(tokens / trainers[name].step(args.steps))
    row = {"family": family_of(config), "dtype": variant, "flops_per_token": flops_per_token,
           "peak": "fp32" if variant in ("fp32", "compile") else "bf16"}
    for name in ("ours", "hf"):
        tps = statistics.median(rates[name])
        row[name] = tps
        row[f"loss_{name}"] = trainers[name].last_loss
        row[f"spread_{name}"] = (max(rates[name]) - min(rates[name])) / tps
    row["ratio"] = row["ours"] / row["hf"]
    return row


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="named config in configs/models/ (e.g. small-gpt); sets the "
                   "family; shape flags below override its fields")
    p.add_argument("--families", default="gpt,llama", help="comma list of gpt, llama")
    p.add_argument("--dtypes", default=",".join(VARIANTS),
                   help=f"comma list of {', '.join(VARIANTS)} (module docstring)")
    p.add_argument("--hidden-size", type=int)
    p.add_argument("--num-layers", type=int)
    p.add_argument("--num-attention-heads", type=int)
    p.add_argument("--num-query-groups", type=int, help="llama family (default 2)")
    p.add_argument("--ffn-hidden-size", type=int, help="llama family (default 688 * h / 256)")
    p.add_argument("--seq-length", type=int)
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=2, help="timed steps per model per round")
    p.add_argument("--rounds", type=int, default=6, help="alternating ours/HF rounds")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per model first")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in VARIANTS:
            raise SystemExit(f"--dtypes: unknown variant {d!r}; use some of {', '.join(VARIANTS)}")
    if args.model:
        configs = [named_config(args.model, args)]
    else:
        configs = [default_config(f.strip(), args) for f in args.families.split(",") if f.strip()]

    import transformers
    transformers.logging.set_verbosity_error()  # config notes about unused token ids / loss_type
    threads = torch.get_num_threads() if device.type == "cpu" else None
    tuned = tune_host_allocator()  # as train.py does; process-wide, so both models get it
    print(f"device {device}" + (f" ({threads} threads)" if threads else "")
          + f", torch {torch.__version__}, transformers {transformers.__version__}; host "
          f"allocator {'tuned (both models)' if tuned else 'default'} ({HOST_SWITCH}=default "
          f"keeps glibc's)")
    print("variants: fp32 = float32 weights and compute; bf16 = float32 weights and AdamW "
          "state, forward/backward under torch.autocast(bfloat16), same for both models; "
          "bf16-main = ours with bf16 weights and float32 main weights (train.py --bf16) "
          "against HF under autocast; compile = fp32 with each layer torch.compile'd, both")
    kinds = sorted({"fp32" if d in ("fp32", "compile") else "bf16" for d in dtypes})
    peaks = {k: PeakFlops(device, torch.bfloat16 if k == "bf16" else torch.float32)
             for k in kinds}
    for k in kinds:
        print(f"peak {k}: {peaks[k].describe()}")

    rows = []
    for config in configs:
        b, s = args.micro_batch_size, config.seq_length
        gen = torch.Generator().manual_seed(args.seed)
        tokens = torch.randint(0, config.vocab_size, (b, s + 1), generator=gen)
        batch = (tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device))
        fpt = training_flops_per_token(config)
        fam = family_of(config)
        print(f"\n[{fam}] {config.name}: h={config.hidden_size} layers={config.num_layers} "
              f"heads={config.num_attention_heads} kv_groups={config.num_query_groups} "
              f"ffn={config.ffn_hidden_size} seq={s} vocab={config.vocab_size} batch={b}; "
              f"{fpt / 1e6:.2f} MFLOP/token (train, 3x fwd)")
        l_ours, l_hf = sanity_check(config, args.seed, batch, device)
        agree = abs(l_ours - l_hf) <= 1e-4 * max(1.0, abs(l_hf))
        print(f"  sanity (fp32, same weights, no grad): loss ours {l_ours:.6f}  HF {l_hf:.6f}  "
              f"|diff| {abs(l_ours - l_hf):.2e}  {'AGREE' if agree else 'MISMATCH (bug)'}")
        for d in dtypes:
            row = bench_one(config, d, args, batch, device, fpt)
            rows.append(row)
            print(f"  {d}: ours {row['ours']:.0f} tok/s  HF {row['hf']:.0f} tok/s  "
                  f"ratio {row['ratio']:.3f}  (round spread ours {row['spread_ours']:.0%}, "
                  f"HF {row['spread_hf']:.0%}; last loss ours {row['loss_ours']:.4f} "
                  f"HF {row['loss_hf']:.4f})")

    print(f"\n{'family':<7} {'variant':<9} {'ours tok/s':>11} {'HF tok/s':>10} "
          f"{'ours/HF':>8} {'MFU ours':>9} {'MFU HF':>8}")
    pct = lambda x: "n/a" if x is None else f"{x:.1%}"  # noqa: E731
    for r in rows:
        mfu = {n: peaks[r["peak"]].mfu(r[n] * r["flops_per_token"] / 1e12) for n in ("ours", "hf")}
        print(f"{r['family']:<7} {r['dtype']:<9} {r['ours']:>11.0f} {r['hf']:>10.0f} "
              f"{r['ratio']:>7.3f}x {pct(mfu['ours']):>9} {pct(mfu['hf']):>8}")
    for k in kinds:
        if peaks[k].note:
            print(f"MFU n/a for {k}: {peaks[k].note}")
    noisy = [f"{r['family']} {r['dtype']}" for r in rows
             if max(r["spread_ours"], r["spread_hf"]) > NOISY_SPREAD]
    if noisy:
        print(f"WARNING: round-to-round spread above {NOISY_SPREAD:.0%} for {', '.join(noisy)}: "
              f"the machine was busy; rerun on an idle machine (or raise --rounds)")
    print()
    for r in rows:
        met = "MET" if r["ratio"] >= TARGET else "NOT MET"
        print(f"target ours >= {TARGET}x HF, {r['family']} {r['dtype']}: {met} "
              f"({r['ratio']:.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
