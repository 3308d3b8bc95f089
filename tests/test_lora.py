"""LoRA adapters on the parallel linear layers (layers/lora.py): the loss, the adapters'
gradients and the dropout masks of a tiny GQA SwiGLU model at tp 2 (with and without sequence
parallelism) equal one process's; the base path is untouched without adapters; bad targets
are refused."""
from __future__ import annotations

import pytest
import torch

from distributed import run_distributed

B, S = 2, 8


def _cfg(**kw):
    from models.config import ModelConfig

    return ModelConfig(**{**dict(
        num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=24, vocab_size=64, seq_length=S, max_position_embeddings=S,
        position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0), **kw})


def _run(sp: bool, targets: str, dropout: float, fmt: str | None = None) -> dict:
    """Loss and dense adapter grads of the tiny model with adapters (B seeded non-zero);
    `fmt`: the base's linears held in that low-bit format (QLoRA), hidden 64, ffn 128."""
    import parallel_state as ps
    from layers import unshard_tensors
    from layers.lora import add_lora, lora_parameters
    from layers.sharding import make_full_tensor, shard_tensor
    from models.gpt import GPTModel
    from parallel_state import collectives

    from layers.quantized import quantize_layer_linears

    # the dropout key as a fresh process has it, whatever an earlier test in this one left
    ps.model_parallel_seed(1234, 0, dropout_masks="sample")
    torch.manual_seed(0)
    model = GPTModel(_cfg(**(dict(hidden_size=64, ffn_hidden_size=128) if fmt else {})),
                     sequence_parallel=sp)
    add_lora(model, rank=4, alpha=8.0, dropout=dropout, target_modules=targets)
    model.init_weights(5)
    if fmt:  # each rank's shard quantized: the dense blocks of 32, split whole over TP
        quantize_layer_linears(model, fmt)
    params = lora_parameters(model)
    with torch.no_grad():
        for name, p in params.items():
            if name.split(".")[-2] == "B":  # non-zero B, the same dense tensor at any tp
                p.init = "normal"
                p.copy_(shard_tensor(make_full_tensor(p, name, 9, 0.5, 1), p))
                p.init = "zeros"
    ids = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(3))
    model.train()
    with ps.dropout_sample_ids(torch.arange(B) + 10):
        loss = model(ids, labels=ids.roll(-1, 1)).mean()
    loss.backward()
    ps.all_reduce_sequence_parallel_grads(params.values())  # as the training loop does
    tp = ps.get_tensor_model_parallel_world_size()
    grads = {}
    for name, p in params.items():
        g = p.grad
        if tp > 1 and p.tensor_model_parallel:
            parts = [torch.empty_like(g) for _ in range(tp)]
            collectives.all_gather(parts, g.contiguous(),
                                   group=ps.get_tensor_model_parallel_group())
            g = unshard_tensors(parts, p)
        grads[name] = g.clone()
    frozen = [n for n, p in model.named_parameters() if p.requires_grad != (n in params)]
    base_grads = [n for n, p in model.named_parameters() if n not in params and p.grad is not None]
    return {"loss": loss.detach(), "grads": grads, "frozen_wrong": frozen,
            "base_grads": base_grads}


CASES = [(sp, t, d, None) for sp in (False, True)
         for t, d in (("all-linear", 0.3), ("q_proj,v_proj,down_proj", 0.0))] + \
    [(sp, "all-linear", 0.3, "int4") for sp in (False, True)]


def _suite():
    return {case: _run(*case) for case in CASES}


def test_lora_at_tp2_with_and_without_sp_matches_one_process(no_grid):
    """Also with an int4 base (QLoRA): its input gradients through the low-bit shards."""
    results = run_distributed(_suite, 2, tp=2)
    for (sp, targets, dropout, fmt), got in results[0].items():
        ref = _run(False, targets, dropout, fmt)
        what = f"tp2 sp={sp} targets={targets} dropout={dropout} base={fmt or 'float'}"
        assert not got["frozen_wrong"] and not got["base_grads"], what
        assert set(got["grads"]) == set(ref["grads"]), what
        torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-5, atol=1e-6, msg=what)
        for name, g in ref["grads"].items():
            assert g.abs().sum() > 0, f"{name}: zero gradient ({what})"
            torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-6,
                                       msg=f"{name} grad, {what}")
        other = results[1][(sp, targets, dropout, fmt)]
        for name, g in other["grads"].items():  # a replicated gradient is whole on both ranks
            torch.testing.assert_close(g, got["grads"][name], rtol=0, atol=0)


def test_targets_parts_and_shapes(no_grid):
    from layers.lora import add_lora, lora_parameters, resolve_targets
    from models.gpt import GPTModel

    assert resolve_targets("linear_qkv,o_proj") == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert len(resolve_targets("all-linear")) == 7
    with pytest.raises(ValueError, match="unknown module 'qkv'"):
        resolve_targets("qkv")
    with pytest.raises(ValueError, match="names no module"):
        resolve_targets(" , ")
    model = GPTModel(_cfg())
    add_lora(model, rank=4, alpha=4.0, target_modules="k_proj,gate_proj")
    names = sorted(lora_parameters(model))
    assert names[:4] == ["decoder.layers.0.mlp.linear_fc1.lora.A.gate_proj",
                         "decoder.layers.0.mlp.linear_fc1.lora.B.gate_proj",
                         "decoder.layers.0.self_attention.linear_qkv.lora.A.k_proj",
                         "decoder.layers.0.self_attention.linear_qkv.lora.B.k_proj"]
    qkv = model.decoder.layers["0"].self_attention.linear_qkv
    assert qkv.lora.A["k_proj"].shape == (4, 16) and qkv.lora.B["k_proj"].shape == (8, 4)
    assert model.decoder.layers["0"].self_attention.linear_proj.lora is None
    with pytest.raises(ValueError, match="--lora-rank must be >= 1"):
        add_lora(GPTModel(_cfg()), rank=0, alpha=1.0)


def test_zero_b_leaves_the_base_output(no_grid):
    """At init (B = 0) the adapted model computes the base model's logits exactly."""
    from layers.lora import add_lora
    from models.gpt import GPTModel

    ids = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(1))
    base = GPTModel(_cfg())
    base.init_weights(5)
    adapted = GPTModel(_cfg())
    add_lora(adapted, rank=4, alpha=8.0)
    adapted.init_weights(5)
    assert sum(p.requires_grad for p in adapted.parameters()) == 2 * 7 * 2
    with torch.no_grad():
        assert torch.equal(base(ids), adapted(ids))


# --- training at every layout ---------------------------------------------------------------

BASE = ["--config", "configs/tiny-llama.yaml", "--num-layers", "2", "--seq-length", "32",
        "--train-iters", "4", "--log-interval", "1", "--eval-interval", "0",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--no-tensorboard",
        "--peak-tflops", "1", "--no-untie-embeddings-and-output-weights", "--lr", "3e-3"]
ADAPTERS = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-dropout", "0.2"]
LORA = BASE + ADAPTERS
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
       "--moe-layer-freq", "2"]  # layer 1 MoE (no adapters on its MLP), layer 0 dense
TRAIN_LAYOUTS = {1: [[], MOE],  # the references: dense, MoE
                 2: [["--tp", "2", "--sequence-parallel"],
                     ["--pp", "2", "--recompute-granularity", "full"],
                     ["--use-distributed-optimizer", "--data-parallel-sharding-strategy",
                      "optim_grads"], ["--context-parallel-size", "2"],
                     ["--data-parallel-sharding-strategy", "optim_grads_params"],
                     MOE + ["--ep", "2"]]}

def _base_digest(chunks) -> str:
    """sha256 of the dense frozen weights (every parameter but the adapters), by name."""
    import hashlib

    from models.state_dict import gather_full_state_dict

    full = gather_full_state_dict(chunks)
    h = hashlib.sha256()
    for name in sorted(full):
        if ".lora." not in name:
            h.update(name.encode() + full[name].numpy().tobytes())
    return h.hexdigest()


def _train_lora(runs: list[list[str]], log_dir: str, cache: str) -> list:
    """pretrain() once per argument list: (losses, grad norms, base digest after training,
    the trainable parameters' names)."""
    import os

    import parallel_state as ps
    from training.arguments import parse_config
    from training.trainer import pretrain

    os.environ["SHARDZOO_CACHE"] = cache
    out = []
    for i, args in enumerate(runs):
        ps.destroy_model_parallel()
        seen = {}

        def on_end(chunks):
            seen["trainable"] = sorted(n for c in chunks for n, p in c.named_parameters()
                                       if p.requires_grad)
            return _base_digest(chunks)

        records = pretrain(parse_config(args + ["--log-dir", f"{log_dir}/{i}"]), on_end=on_end)
        steps = [r for r in records if "loss" in r]
        digest = next(r["on_end"] for r in records if "on_end" in r)
        out.append(([r["loss"] for r in steps], [r["grad_norm"] for r in steps], digest,
                    seen["trainable"]))
    return out


def test_lora_training_on_every_layout_matches_one_process(tmp_path, corpus_env, no_grid):
    """Loss and gradient-norm curves with LoRA dropout on at tp 2 + SP, pp 2 (tied
    embeddings; full recompute), dp 2 with ZeRO-2 and ZeRO-3, cp 2, and ep 2 (an MoE model)
    equal one process's; only adapters train (the base after training is bitwise the seeded
    initial base, at every layout)."""
    from models.gpt import GPTModel
    from tolerances import assert_losses_close, training_chain_terms
    from training.arguments import parse_config

    cache = corpus_env["SHARDZOO_CACHE"]
    res = {w: run_distributed(_train_lora, w, [LORA + f for f in flags], str(tmp_path / str(w)),
                              cache, timeout=600)[0] for w, flags in TRAIN_LAYOUTS.items()}
    for flags, (losses, _, digest, trainable) in zip(TRAIN_LAYOUTS[1], res[1]):
        config = parse_config(LORA + flags)
        fresh = GPTModel(config.model)
        fresh.init_weights(config.train.seed)
        assert digest == _base_digest([fresh]), f"the base changed in training ({flags})"
        assert trainable and all(".lora." in n for n in trainable), trainable
        assert losses[-1] < losses[0], losses
    for flags, (losses, norms, digest, _) in zip(TRAIN_LAYOUTS[2], res[2], strict=True):
        ref_losses, ref_norms, ref_digest, _ = res[1][int(flags[:len(MOE)] == MOE)]
        k_step = training_chain_terms(LORA + flags)
        assert_losses_close(losses, ref_losses, k_step, f"losses at {flags}")
        assert_losses_close(norms, ref_norms, k_step, f"grad norms at {flags}")
        assert digest == ref_digest, f"base changed at {flags}"


@pytest.mark.parametrize("extra, message", [
    (["--lora-rank", "-1"], "--lora-rank -1 must be >= 1"),
    (["--lora-rank", "4", "--lora-dropout", "1"], "--lora-dropout 1.0 must be in"),
    (["--lora-rank", "4", "--lora-target-modules", "qkv"], "unknown module 'qkv'"),
    (["--config", "configs/t5-demo.yaml", "--lora-rank", "4"], "built for decoder-only"),
    (["--lora-base-quantization", "int4"], "add --lora-rank"),
    (["--lora-rank", "4", "--lora-base-quantization", "nf4"], "lora-base-quantization"),
    (["--lora-rank", "4", "--lora-base-quantization", "q4_0", "--hidden-size", "48"],
     "do not divide --hidden-size = 48"),
])
def test_bad_lora_flags_are_refused_before_the_run(extra, message):
    from models.config import ConfigError
    from training.arguments import parse_config

    config = parse_config((["--config", "configs/tiny-llama.yaml"] if "--config" not in extra
                           else []) + extra)
    with pytest.raises(ConfigError, match=message):
        config.validate(1)


# --- checkpoints: adapters only, resumed at another layout, onto the recorded base only ------

def _runs_or_errors(runs: list[list[str]], cache: str) -> list:
    """pretrain() per argument list: its losses, or the text of the exception it raised."""
    import os

    import parallel_state as ps
    from training.arguments import parse_config
    from training.trainer import pretrain

    os.environ["SHARDZOO_CACHE"] = cache
    out = []
    for args in runs:
        ps.destroy_model_parallel()
        try:
            records = pretrain(parse_config(args))
        except Exception as e:  # noqa: BLE001 - the test reads the message
            out.append(f"{type(e).__name__}: {e}")
            continue
        out.append([r["loss"] for r in records if "loss" in r])
    return out


def test_lora_checkpoint_holds_adapters_resumes_at_tp2_and_refuses_another_base(
        tmp_path, corpus_env, no_grid):
    import json
    import shutil

    from tolerances import assert_losses_close, training_chain_terms

    cache = corpus_env["SHARDZOO_CACHE"]
    base, other, ckpt = tmp_path / "base", tmp_path / "other", tmp_path / "lora"
    log = lambda name: ["--log-dir", str(tmp_path / "logs" / name)]  # noqa: E731
    one = run_distributed(_runs_or_errors, 1, [
        BASE + ["--train-iters", "1", "--lr-warmup-iters", "0", "--save", str(base)] + log("base"),
        BASE + ["--train-iters", "1", "--lr-warmup-iters", "0", "--seed", "7", "--save",
                str(other)] + log("other"),
        LORA + ["--load", str(base)] + log("whole"),
        LORA + ["--load", str(base), "--save", str(ckpt), "--exit-interval", "2"] + log("half"),
    ], cache, timeout=600)[0]
    assert all(isinstance(r, list) for r in one), one
    whole, half = one[2], one[3]
    assert len(whole) == 4 and half == whole[:2], (whole, half)
    assert whole[-1] < whole[0], whole
    saved = ckpt / "iter_0000002"
    meta = json.loads((saved / "metadata.json").read_text())
    assert meta["lora"]["rank"] == 4 and meta["lora"]["base"]["path"] == str(
        base / "iter_0000001") and len(meta["lora"]["base"]["sha256"]) == 64
    adapters_bytes = sum(f["bytes"] for f in meta["files"] if f["name"].endswith(".distcp"))
    base_bytes = sum(f["bytes"] for f in json.loads(
        (base / "iter_0000001" / "metadata.json").read_text())["files"]
        if f["name"].endswith(".distcp"))
    assert adapters_bytes * 5 < base_bytes, (adapters_bytes, base_bytes)  # no base weights

    resume = LORA + ["--load", str(ckpt), "--tp", "2", "--sequence-parallel"]
    shutil.copytree(ckpt, tmp_path / "lora-copy")
    two = run_distributed(_runs_or_errors, 2, [
        resume + log("resumed"),
        BASE + ["--load", str(ckpt)] + log("no-lora"),
        BASE + ["--lora-rank", "8", "--load", str(ckpt)] + log("rank8"),
    ], cache, timeout=600)[0]
    assert isinstance(two[0], list) and len(two[0]) == 2, two[0]
    assert_losses_close(two[0], whole[2:], training_chain_terms(LORA) * 2, "resumed at tp2")
    assert "holds LoRA adapters only" in two[1] and "--lora-" in two[1], two[1]
    assert "rank: checkpoint 4, this run 8" in two[2], two[2]

    # the recorded base folder now holds other weights: refused before any step
    shutil.rmtree(base / "iter_0000001")
    shutil.copytree(other / "iter_0000001", base / "iter_0000001")
    three = run_distributed(_runs_or_errors, 1, [
        LORA + ["--load", str(tmp_path / "lora-copy")] + log("other-base")], cache,
        timeout=300)[0]
    assert "CheckpointError" in three[0] and "now holds other weights" in three[0], three[0]


# --- peft's files: export-adapter and merge ---------------------------------------------------

def _hf_base(kind: str, folder):
    """A tiny random transformers Llama or Qwen3 (vocab 8192: the test corpus's) saved."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=8192, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**common)) if kind == "llama" else \
        Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    model.save_pretrained(folder)
    return model


def _our_logits(base: str, adapters: str, ids: torch.Tensor) -> torch.Tensor:
    """Logits `[b, s, vocab]` of our model: the base checkpoint's weights + the adapters."""
    import json

    from checkpoint.format import require_checkpoint
    from checkpoint.model_io import load_model_weights
    from models.config import ModelConfig

    path = require_checkpoint(adapters)
    meta = json.loads(open(f"{path}/metadata.json").read())
    config, lora = ModelConfig.from_dict(meta["model"]), meta["lora"]
    from layers.lora import add_lora
    from models.gpt import GPTModel

    model = GPTModel(config)
    add_lora(model, lora["rank"], lora["alpha"], lora["dropout"], lora["target_modules"],
             lora["use_rslora"])
    load_model_weights(require_checkpoint(base), [model], part="base")
    load_model_weights(path, [model])
    model.eval()
    with torch.no_grad():
        return model(ids)[..., :config.vocab_size]


def _import_and_train(tmp_path, corpus_env, targets: str, *extra: str,
                      imported: str | None = None) -> list:
    """Import the HF model of `tmp_path/hf` into `tmp_path/base` and train 2 iterations of
    rank-4 adapters on it at tp 2 into `tmp_path/lora`: `_runs_or_errors`' result. With
    `imported` (a peft adapter folder for that model, its r=4, alpha 16 and targets this
    run's), also import-adapter it and continue training from it at tp 2 + SP, in the same
    spawned processes (into `tmp_path/continued`)."""
    from tools.convert_hf import main as convert

    assert convert(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "base")]) == 0
    run = ["--config", str(tmp_path / "base" / "config.yaml"), "--seq-length", "32",
           "--micro-batch-size", "2", "--global-batch-size", "4", "--eval-interval", "0",
           "--no-tensorboard", "--peak-tflops", "1", "--tp", "2", "--train-iters", "2",
           "--lr", "2e-2", "--lr-warmup-iters", "0", "--lora-rank", "4", "--lora-alpha", "16",
           "--lora-target-modules", targets, *extra]
    runs = [run + ["--load", str(tmp_path / "base"), "--save", str(tmp_path / "lora"),
                   "--log-dir", str(tmp_path / "log")]]
    if imported:
        assert convert(["import-adapter", "--adapter", imported, "--base",
                        str(tmp_path / "base"), "--out", str(tmp_path / "from-peft")]) == 0
        runs.append(run + ["--load", str(tmp_path / "from-peft"), "--sequence-parallel",
                           "--save", str(tmp_path / "continued"),
                           "--log-dir", str(tmp_path / "log2")])
    return run_distributed(_runs_or_errors, 2, runs, corpus_env["SHARDZOO_CACHE"],
                           timeout=300)[0]


@pytest.mark.parametrize("kind, targets", [("llama", "all-linear"),
                                           ("qwen3", "q_proj,v_proj,o_proj,up_proj")])
def test_exported_adapter_loads_in_peft_and_merge_folds_it(kind, targets, tmp_path, corpus_env,
                                                           no_grid):
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tools.convert_hf import main as convert

    from peft import LoraConfig, get_peft_model

    from checkpoint.lora_files import read_adapters
    from layers.lora import resolve_targets

    hf = _hf_base(kind, tmp_path / "hf")
    ckpt = tmp_path / "lora"
    torch.manual_seed(2)  # peft's adapter with random A and B (import-adapter, then training)
    get_peft_model(AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")), LoraConfig(
        r=4, lora_alpha=16, use_rslora=True, target_modules=list(resolve_targets(targets)),
        init_lora_weights=False)).save_pretrained(str(tmp_path / "peft"))
    run = _import_and_train(tmp_path, corpus_env, targets, "--use-rslora",
                            imported=str(tmp_path / "peft"))
    assert isinstance(run[0], list) and isinstance(run[1], list), run
    # the continued run starts from peft's adapters (not B = 0: the base's loss) and trains
    assert abs(run[1][0] - run[0][0]) > 1e-3 and run[1][-1] < run[1][0], run
    continued = json.loads((tmp_path / "continued" / "iter_0000002" / "metadata.json")
                           .read_text())["lora"]["base"]
    assert continued["path"] == str(tmp_path / "base"), continued
    out = tmp_path / "adapter"
    assert convert(["export-adapter", "--load", str(ckpt), "--out", str(out)]) == 0
    assert convert(["import-adapter", "--adapter", str(out), "--base", str(tmp_path / "base"),
                    "--out", str(tmp_path / "back")]) == 0
    trained, back = read_adapters(str(ckpt))[2], read_adapters(str(tmp_path / "back"))[2]
    assert trained.keys() == back.keys() and all(
        torch.equal(trained[m][i], back[m][i]) for m in trained for i in (0, 1))
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["use_rslora"] is True
    ids = torch.randint(0, 8192, (2, 12), generator=torch.Generator().manual_seed(4))
    ours = _our_logits(str(tmp_path / "base"), str(ckpt), ids)
    with torch.no_grad():
        base_logits = hf(ids).logits
        peft_logits = PeftModel.from_pretrained(hf, str(out)).eval()(ids).logits
    assert (peft_logits - base_logits).abs().max() > 1e-3, "the adapters change nothing"
    torch.testing.assert_close(peft_logits, ours, rtol=1e-4, atol=1e-4)

    merged = tmp_path / "merged"
    assert convert(["merge", "--load", str(ckpt), "--out", str(merged)]) == 0
    plain = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, ours, rtol=1e-4, atol=1e-4)
    assert convert(["export-adapter", "--load", str(tmp_path / "base"), "--out",
                    str(tmp_path / "x")]) == 1  # not a LoRA checkpoint: refused


# --- QLoRA: a low-bit frozen base --------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["int4", "q4_0"])
def test_qlora_trains_without_dequantizing_a_whole_weight(fmt, monkeypatch, no_grid):
    """Adapters over an int4 / GGUF q4_0 base: the input gradient goes through the low-bit
    weights (a slab of rows de-quantized at a time, never a whole weight), the loss falls,
    the quantized base is untouched, and the gradients match those through the float
    de-quantized base."""
    import layers.quant.weight as qw
    from layers.lora import add_lora, lora_parameters
    from layers.quant import QuantizedWeight
    from layers.quantized import quantize_layer_linears, quantized_weights
    from models.gpt import GPTModel

    cfg = dict(hidden_size=64, ffn_hidden_size=96)  # blocks of 32 divide every input
    model = GPTModel(_cfg(**cfg))
    add_lora(model, rank=4, alpha=8.0)
    model.init_weights(5)
    assert quantize_layer_linears(model, fmt) == 8
    with pytest.raises(ValueError, match="only a frozen base"):
        quantize_layer_linears(GPTModel(_cfg(**cfg)), fmt)
    frozen = {n: {k: v.clone() for k, v in w.tensors.items()}
              for n, w in quantized_weights(model)}
    reference = GPTModel(_cfg(**cfg))  # the same model with the de-quantized weights as floats
    add_lora(reference, rank=4, alpha=8.0)
    reference.init_weights(5)
    with torch.no_grad():
        for n, w in quantized_weights(model):
            reference.get_parameter(n).copy_(w.dequantize())
    rows = []
    dequantize = QuantizedWeight.dequantize
    monkeypatch.setattr(qw, "SLAB_ROWS", 8)
    monkeypatch.setattr(QuantizedWeight, "dequantize",
                        lambda self, *a: rows.append(self.shape[0]) or dequantize(self, *a))
    ids = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(3))
    params = lora_parameters(model)
    opt = torch.optim.AdamW(params.values(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny GEMMs: two threads on a busy 2-core machine run 10x slower
    try:
        _qlora_steps(model, reference, params, ids, opt, rows)
    finally:
        torch.set_num_threads(threads)
    for n, w in quantized_weights(model):
        assert all(torch.equal(v, frozen[n][k]) for k, v in w.tensors.items()), n


def _qlora_steps(model, reference, params, ids, opt, rows) -> None:
    """8 AdamW steps of the QLoRA model's adapters: gradients at step 2 equal the float
    reference's, the loss falls, only slabs of rows are de-quantized."""
    from layers.lora import lora_parameters

    losses = []
    for step in range(8):
        loss = model(ids, labels=ids.roll(-1, 1)).mean()
        opt.zero_grad()
        loss.backward()
        if step == 1:  # B is non-zero after one step: A's gradients flow through the base
            ref_params = lora_parameters(reference)
            with torch.no_grad():
                for n, p in params.items():
                    ref_params[n].copy_(p)
            reference(ids, labels=ids.roll(-1, 1)).mean().backward()
            for n, p in params.items():
                torch.testing.assert_close(p.grad, ref_params[n].grad, rtol=1e-4, atol=1e-6)
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.05, losses
    assert rows and max(rows) <= 8, max(rows)  # slabs only (weights have 64..192 rows)


def test_qlora_training_run_at_tp2_sp_matches_one_process(tmp_path, corpus_env, no_grid):
    """train.py --lora-base-quantization int4: the loaded base held low-bit on every rank;
    tp 2 + SP reproduces one process's curve (the shards quantize the dense blocks), the loss
    falls, and the run saves its adapters; q4_0 (a GGUF block format) trains too."""
    import json

    from tolerances import assert_losses_close, training_chain_terms

    cache = corpus_env["SHARDZOO_CACHE"]
    qlora = LORA + ["--lora-base-quantization", "int4", "--lr", "1e-2"]
    log = lambda name: ["--log-dir", str(tmp_path / name)]  # noqa: E731
    one = run_distributed(_runs_or_errors, 1, [
        qlora + log("one"),
        LORA + ["--lora-base-quantization", "q4_0", "--lr", "1e-2"] + log("q4_0")], cache,
        timeout=300)[0]
    two = run_distributed(_runs_or_errors, 2, [
        qlora + ["--tp", "2", "--sequence-parallel", "--save", str(tmp_path / "ckpt")]
        + log("two")], cache, timeout=300)[0]
    assert all(isinstance(r, list) for r in one + two), (one, two)
    assert one[0][-1] < one[0][0] and one[1][-1] < one[1][0], one
    assert one[0] != one[1]  # another base format, another curve
    assert_losses_close(two[0], one[0], training_chain_terms(qlora), "QLoRA at tp2 + SP")
    meta = json.loads((tmp_path / "ckpt" / "iter_0000004" / "metadata.json").read_text())
    assert meta["lora"]["rank"] == 4
