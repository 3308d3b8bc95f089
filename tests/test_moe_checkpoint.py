"""Checkpoints of mixture-of-experts models stay layout-free.

An MoE layer's stacked expert weights are stored one key per expert under its global number
(`...mlp.experts.<e>.linear_fc1.weight(.part<i>)`, checkpoint/keys.py), the router's
`expert_bias` as model state. A tiny MoE GPT (4 SwiGLU experts, top-2 sigmoid routing with
the expert bias, a gated shared expert; every layer MoE) is saved through the trainer's
`Checkpointer` at (ep 4, tp 1, dp 4) and (ep 2, tp 2, dp 2), each with known weights, Adam
moments and step, and loaded through `load_checkpoint` at (ep 1, dp 4, ZeRO-1), (ep 2, dp 4,
ZeRO-1: the experts' state sharded over expert-DP 2, saved again from there) and (ep 2,
pp 2, dp 2); the inference loader reads it at (tp 2, dp 2). Every loaded weight, moment,
step and bias equals this rank's shard of the known dense tensor bitwise, the logits equal
one process's, and the three checkpoints hold bitwise the same tensors. Hostile copies (an
expert missing, an expert of the wrong shape, metadata.json's num_moe_experts not the
stored experts') are refused before any tensor is read, naming the key.

train.py (pretrain in a spawned world): saved at iteration 3 of 6 at (ep 2, tp 2) and (ep 4),
world 4, resumed at ep 1 (world 1) and at (ep 2, dp 4, ZeRO-1): losses continue the
uninterrupted run's and the expert biases end bitwise equal; resumed at ep 4, bitwise.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from distributed import run_distributed
from tolerances import fp32_mismatch, forward_chain_terms

SEED, MOMENT_SEEDS, STEP = 1234, (77, 78), 7  # the state every layout saves and must load
BIAS = [0.05, -0.02, 0.0, 0.03]  # the router's expert bias (DeepSeek-V3 balancing state)
MODEL = dict(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2,
             ffn_hidden_size=32, seq_length=8, max_position_embeddings=8, vocab_size=64,
             make_vocab_size_divisible_by=8, position_embedding_type="rope",
             normalization="RMSNorm", activation="swiglu", add_bias_linear=False,
             hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.3,
             num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8,
             moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
             moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True)
TOKENS = torch.arange(16).reshape(2, 8) * 5 % 64  # [b, s]
MISSING = "model.decoder.layers.1.mlp.experts.3.linear_fc2.weight"
RESHAPED = "model.decoder.layers.0.mlp.experts.2.linear_fc1.weight.part0"


def _model_config():
    from models import ModelConfig

    config = ModelConfig(**MODEL)
    config.validate()
    return config


# ----------------------------------------------------------------------------- workers
def _config(root: str, ep: int, tp: int, pp: int, zero: bool, **paths):
    """The run's `Config` as train.py builds it, and the grid built from it."""
    import parallel_state as ps
    from training.arguments import parse_config
    from training.trainer import pipeline_copies

    argv = ["--config", os.path.join(root, "model.yaml"), "--tp", str(tp), "--pp", str(pp),
            "--ep", str(ep), "--micro-batch-size", "1", "--global-batch-size", "4",
            "--train-iters", "10", "--seed", "5"] + ["--use-distributed-optimizer"] * zero
    for flag, path in paths.items():
        argv += [f"--{flag}", path]
    config = parse_config(argv).validate(4)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, pp, device="cpu", expert_model_parallel_size=ep,
                                 **pipeline_copies(config))
    return config


def _full(p, name: str, seed: int) -> torch.Tensor:
    """This rank's shard of the dense tensor that `seed` gives parameter `name`."""
    from layers import shard_tensor
    from layers.sharding import make_full_tensor

    m = MODEL
    key = getattr(p, "init_key", None) or name
    return shard_tensor(make_full_tensor(p, key, seed, m["init_method_std"], m["num_layers"]), p)


def _known_state(chunks, optimizer) -> None:
    """Weights from SEED, Adam moments from MOMENT_SEEDS (the second squared), step STEP, the
    bias BIAS: values every layout can compute for its own shards (AdamW only)."""
    with torch.no_grad():
        for chunk in chunks:
            chunk.init_weights(SEED)
            for name, p in chunk.named_parameters():
                optimizer.state[p] = {"step": torch.tensor(float(STEP)),
                                      "exp_avg": _full(p, name, MOMENT_SEEDS[0]),
                                      "exp_avg_sq": _full(p, name, MOMENT_SEEDS[1]) ** 2}
            for name, b in chunk.named_buffers():
                if name.endswith("expert_bias"):
                    b.copy_(torch.tensor(BIAS))


def _check_state(chunks, model, optimizer) -> list[str]:
    """What differs (bitwise) from `_known_state` in the loaded parameters, main weights,
    moments (ZeRO: gathered), step and bias of this rank."""
    from training.checkpointing import _param_values

    values, step = _param_values(chunks, model, optimizer)
    bad = [] if step == STEP else [f"step {step}"]
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            sq = _full(p, name, MOMENT_SEEDS[1]) ** 2
            for what, got, want in (("weight", p.detach(), _full(p, name, SEED)),
                                    ("model", values[id(p)]["model"], _full(p, name, SEED)),
                                    ("exp_avg", values[id(p)]["optim.exp_avg"],
                                     _full(p, name, MOMENT_SEEDS[0])),
                                    ("exp_avg_sq", values[id(p)]["optim.exp_avg_sq"], sq)):
                if not torch.equal(got.reshape(want.shape), want):
                    bad.append(f"{what} {name}")
        for name, b in chunk.named_buffers():
            if name.endswith("expert_bias") and not torch.equal(b, torch.tensor(BIAS)):
                bad.append(f"buffer {name}: {b.tolist()}")
    return bad


@torch.no_grad()
def _logits(chunk) -> torch.Tensor:
    """The model's `[b, s, vocab]` logits of TOKENS (one pipeline stage), gathered over TP."""
    import parallel_state as ps

    local = chunk.eval()(TOKENS)
    tp = ps.get_tensor_model_parallel_world_size()
    parts = [torch.empty_like(local) for _ in range(tp)]
    torch.distributed.all_gather(parts, local.contiguous(),
                                 group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, -1)[..., :MODEL["vocab_size"]]


def _save(root: str, name: str, layout: tuple) -> None:
    from training.checkpointing import Checkpointer, DataPosition
    from training.trainer import setup_model_and_optimizer

    config = _config(root, *layout, save=os.path.join(root, name))
    chunks, model, optimizer = setup_model_and_optimizer(config, torch.device("cpu"))
    _known_state(chunks, optimizer)
    Checkpointer(config).save(3, chunks, model, optimizer, DataPosition(12))


def _load(root: str, name: str, layout: tuple, resave: str | None = None) -> dict:
    from training.checkpointing import Checkpointer, load_checkpoint
    from training.trainer import setup_model_and_optimizer

    paths = {"load": os.path.join(root, name)}
    if resave:
        paths["save"] = os.path.join(root, resave)
    config = _config(root, *layout, **paths)
    chunks, model, optimizer = setup_model_and_optimizer(config, torch.device("cpu"))
    resume = load_checkpoint(config, chunks, model, optimizer)
    out = {"iteration": resume.iteration, "consumed": resume.position.consumed_samples,
           "bad": _check_state(chunks, model, optimizer),
           "logits": _logits(chunks[0]) if layout[2] == 1 else None}
    if resave:
        Checkpointer(config).save(resume.iteration, chunks, model, optimizer, resume.position)
    return out


def _inference(root: str, name: str) -> torch.Tensor:
    """infer.py's loader at (tp 2, dp 2) (its grid has no ep: every rank holds all experts)."""
    import parallel_state as ps
    from inference.loading import load

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(2, 1, device="cpu")
    model, _, _ = load(load=os.path.join(root, name))
    return _logits(model)


def _refused(root: str, name: str) -> str:
    """The error every rank raises loading hostile copy `name` at (ep 2, tp 2)."""
    from checkpoint.format import CheckpointError
    from training.checkpointing import load_checkpoint
    from training.trainer import setup_model_and_optimizer

    config = _config(root, 2, 2, 1, False, load=os.path.join(root, name))
    chunks, model, optimizer = setup_model_and_optimizer(config, torch.device("cpu"))
    try:
        load_checkpoint(config, chunks, model, optimizer)
    except CheckpointError as e:
        return str(e)
    return "loaded"


def _worker(root: str) -> dict:
    import torch.distributed as dist

    _save(root, "ep4", (4, 1, 1, False))  # (ep, tp, pp, ZeRO-1)
    _save(root, "ep2tp2", (2, 2, 1, False))
    if dist.get_rank() == 0:  # a hostile copy for the world's own verification
        _rewrite(Path(root, "ep4", "iter_0000003"), Path(root, "missing"), _drop_expert)
    dist.barrier()
    loads = {"ep4->ep1dp4zero": _load(root, "ep4", (1, 1, 1, True)),
             "ep2tp2->ep1dp4zero": _load(root, "ep2tp2", (1, 1, 1, True)),
             "ep4->ep2dp4zero": _load(root, "ep4", (2, 1, 1, True), resave="ep2zero"),
             "ep2tp2->ep2pp2": _load(root, "ep2tp2", (2, 1, 2, False))}
    return {"loads": loads, "inference": _inference(root, "ep2tp2"),
            "refused": _refused(root, "missing")}


# ----------------------------------------------------------------------------- parent side
def _stored(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of checkpoint `folder` by key (one process, read as untrusted input)."""
    from checkpoint import safe_dcp
    from checkpoint.format import read_metadata
    from checkpoint.safe_dcp import single_process

    meta = read_metadata(str(folder))
    md = safe_dcp.read_dcp_metadata(str(folder), meta)
    sd = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
          for k, v in md.state_dict_metadata.items()}
    with single_process():
        safe_dcp.load(sd, str(folder), md, no_dist=True)
    return sd


def _rewrite(src: Path, dst: Path, edit) -> None:
    """Copy checkpoint `src` to `dst` with its tensors changed by `edit(dict)` (a crafted
    checkpoint whose files all match its metadata.json)."""
    import torch.distributed.checkpoint as dcp

    from checkpoint.format import describe_files
    from checkpoint.safe_dcp import single_process

    sd = _stored(src)
    edit(sd)
    dst.mkdir()
    with single_process():
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(dst)), no_dist=True)
    shutil.copy(src / "config.yaml", dst / "config.yaml")
    meta = json.loads((src / "metadata.json").read_text())
    meta["files"] = describe_files(str(dst), [n for n in os.listdir(dst)])
    (dst / "metadata.json").write_text(json.dumps(meta))


def _edit_model(src: Path, dst: Path, **fields) -> None:
    """A copy of `src` whose metadata.json's model says `fields` (its files unchanged)."""
    shutil.copytree(src, dst)
    meta = json.loads((dst / "metadata.json").read_text())
    meta["model"].update(fields)
    (dst / "metadata.json").write_text(json.dumps(meta))


def _reference():
    """One process: the dense model with the known weights and bias, and its logits."""
    from models import GPTModel

    model = GPTModel(_model_config())
    model.init_weights(SEED)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(torch.tensor(BIAS))
        logits = model.eval()(TOKENS)[..., :MODEL["vocab_size"]]
    return model, logits


def _drop_expert(sd: dict) -> None:
    """Remove expert 3 of layer 1's fc2 (its weight and moments)."""
    for kind in ("model", "optim.exp_avg", "optim.exp_avg_sq"):
        del sd[kind + MISSING[len("model"):]]


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    """`(root, per-rank results)` of one world of 4 (`_worker`)."""
    root = tmp_path_factory.mktemp("moe-ckpt")
    (root / "model.yaml").write_text(yaml.safe_dump(MODEL))
    return root, run_distributed(_worker, 4, str(root), timeout=600)


def _ckpt(root: Path, name: str) -> Path:
    return root / name / "iter_0000003"


def test_saved_at_any_layout_loads_at_any_layout(moe_checkpoints, no_grid, capsys):
    """Saved at (ep 4) and (ep 2, tp 2), loaded at (ep 1, ZeRO), (ep 2, dp 4, ZeRO: saved
    again) and (ep 2, pp 2): every weight, moment, step and bias bitwise the known ones;
    logits (also the inference loader's at tp 2) equal one process's; the three checkpoints
    hold the same tensors; metadata.json records ep and the MoE fields."""
    from checkpoint.model_io import read_dense_weights
    from tools import checkpoint_info

    root, results = moe_checkpoints
    reference, ref_logits = _reference()
    k = forward_chain_terms(_model_config(), MODEL["seq_length"])
    bad = []
    for rank, r in enumerate(results):
        for name, load in r["loads"].items():
            bad += [f"rank {rank} {name}: {b}" for b in load["bad"]]
            if (load["iteration"], load["consumed"]) != (3, 12):
                bad.append(f"rank {rank} {name}: resumed at {load['iteration']}, "
                           f"{load['consumed']} samples")
            for what, logits in (("logits", load["logits"]), ("inference", r["inference"])):
                problem = logits is not None and fp32_mismatch(logits, ref_logits, k)
                if problem:
                    bad.append(f"rank {rank} {name} {what}: {problem}")
        if MISSING not in r["refused"] or "missing" not in r["refused"]:
            bad.append(f"rank {rank} loaded the checkpoint without {MISSING}: {r['refused']}")
    assert not bad, bad

    stored = {name: _stored(_ckpt(root, name)) for name in ("ep4", "ep2tp2", "ep2zero")}
    keys = {name: {k for k in sd if not k.startswith("rng.")} for name, sd in stored.items()}
    assert keys["ep4"] == keys["ep2tp2"] == keys["ep2zero"]
    assert MISSING in keys["ep4"] and RESHAPED in keys["ep4"]
    assert "optim.exp_avg.decoder.layers.0.mlp.experts.3.linear_fc1.weight.part1" in keys["ep4"]
    assert "model.decoder.layers.1.mlp.router.expert_bias" in keys["ep4"]
    assert not any(k.startswith("optim.") and k.endswith("expert_bias") for k in keys["ep4"])
    differ = [f"{a} {key}" for a in ("ep2tp2", "ep2zero") for key in keys["ep4"]
              if not torch.equal(stored[a][key], stored["ep4"][key])]
    assert not differ, differ

    config, dense = read_dense_weights(str(_ckpt(root, "ep4")))
    want = dict(reference.named_parameters()) | dict(reference.named_buffers())
    for name, read in dense.items():
        expert = re.fullmatch(r"(.*)\.experts\.(\d+)\.(.*)", name)  # one of a stacked weight
        expected = want[f"{expert[1]}.experts.{expert[3]}"][int(expert[2])] if expert else \
            want[name]
        assert torch.equal(read(), expected), name
    assert config.num_moe_experts == 4 and config.moe_router_enable_expert_bias

    layouts = {n: json.loads((_ckpt(root, n) / "metadata.json").read_text())["layout"]
               for n in stored}
    assert [(layouts[n]["ep"], layouts[n]["tp"], layouts[n]["dp"]) for n in stored] == \
        [(4, 1, 4), (2, 2, 2), (2, 1, 4)]
    capsys.readouterr()
    assert checkpoint_info.main([str(_ckpt(root, "ep2zero"))]) == 0
    out = capsys.readouterr().out
    assert "experts: 4 per MoE layer (layers 0, 1), top-2 sigmoid, expert ffn 8, shared " \
           "experts ffn 8, expert bias; stored one tensor per expert" in out, out
    assert " ep=2 etp=1" in out and "status: OK" in out, out


def test_hostile_moe_checkpoints_are_refused_naming_the_key(moe_checkpoints, no_grid,
                                                             tmp_path, capsys):
    """A checkpoint without one expert's tensor, with an expert of the wrong shape, or whose
    metadata.json says 8 or 2 experts where 4 are stored, is refused by checkpoint_info,
    infer.py's loader and the dense reader before any tensor is read, naming the keys; a run
    with another --num-experts is told the checkpoint's; HF export names what no HF family has."""
    from checkpoint.format import CheckpointError, compare_model
    from checkpoint.hf import export_hf
    from checkpoint.model_io import read_dense_weights
    from models.hf import HFConversionError
    from inference.loading import load
    from tools import checkpoint_info

    root, _ = moe_checkpoints
    good = _ckpt(root, "ep4")

    def reshape(sd):
        sd[RESHAPED] = torch.zeros(9, MODEL["hidden_size"])

    _rewrite(good, tmp_path / "reshaped", reshape)
    _edit_model(good, tmp_path / "eight", num_moe_experts=8)
    _edit_model(good, tmp_path / "two", num_moe_experts=2)
    cases = {
        root / "missing": [f"1 missing tensor(s) (layers 1, experts 3: {MISSING})"],
        tmp_path / "reshaped": [f"{RESHAPED} has shape (9, 16), the model's is (8, 16)"],
        tmp_path / "eight": ["missing tensor(s) (layers 0, 1, experts 4, 5, 6, 7: "],
        tmp_path / "two": ["extra tensor(s) (layers 0, 1, experts 2, 3: "],
    }
    for folder, needles in cases.items():
        capsys.readouterr()
        assert checkpoint_info.main([str(folder)]) == 1, folder
        out = capsys.readouterr().out
        assert all(n in out for n in needles), (folder, out)
        for read in (lambda: load(load=str(folder)),  # infer.py --load: model from metadata
                     lambda: read_dense_weights(str(folder))):
            with pytest.raises(CheckpointError) as e:
                read()
            assert all(n in str(e.value) for n in needles), (folder, str(e.value))
    with pytest.raises(HFConversionError, match="mixture-of-experts model has no Hugging Face "
                                                "equivalent .Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE.: "
                                                "moe_router_score_function='sigmoid'"):
        export_hf(str(good), str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()
    meta = json.loads((good / "metadata.json").read_text())
    with pytest.raises(CheckpointError, match="num_moe_experts: checkpoint 4, this run 8.*"
                                              "--num-moe-experts 4"):
        compare_model(meta, {**meta["model"], "num_moe_experts": 8}, str(good))


# ----------------------------------------------------------------------------- train.py resume
TRAIN = ["--config", "configs/tiny-llama.yaml", "--num-experts", "4", "--moe-router-topk", "2",
         "--moe-ffn-hidden-size", "32", "--moe-router-score-function", "sigmoid",
         "--moe-aux-loss-coeff", "0.01", "--moe-router-enable-expert-bias",
         "--moe-router-bias-update-rate", "0.01", "--train-iters", "6", "--log-interval", "1",
         "--eval-interval", "0", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--no-tensorboard", "--adam-eps", "1e-4", "--peak-tflops", "1"]
SAVES = {"ep2tp2": ["--ep", "2", "--tp", "2"], "ep4": ["--ep", "4"]}  # world 4, saved at 3, 6


def _train_runs(runs: list[tuple[str, list[str]]], root: str, cache: str) -> dict:
    """train.py's pretrain() for each (name, flags) in turn in this world: per run the
    losses (metrics.jsonl) and the final expert biases."""
    import parallel_state as ps
    from training.arguments import parse_config
    from training.metrics import read_records
    from training.trainer import pretrain

    os.environ["SHARDZOO_CACHE"] = cache
    out = {}
    for name, flags in runs:
        ps.destroy_model_parallel()  # pretrain builds the grid from the config
        folder = os.path.join(root, "logs", name)
        records = pretrain(parse_config(TRAIN + flags + ["--log-dir", folder]), on_end=lambda c: {
            n: b.clone() for chunk in c for n, b in chunk.named_buffers()
            if n.endswith("expert_bias")})
        out[name] = {"losses": [r["loss"] for r in read_records(folder) if "loss" in r],
                     "biases": records[-1]["on_end"]}
    return out


@pytest.fixture(scope="module")
def moe_train_runs(tmp_path_factory, corpus_env):
    """World 4: the uninterrupted runs at (ep 2, tp 2) and (ep 4), saving at 3 and 6, then
    resumes from their iteration 3 at (ep 2, dp 4, ZeRO-1) and (ep 4); world 1: resumes at
    ep 1. Runs of one world run one after the other in it."""
    root, cache = tmp_path_factory.mktemp("moe-train"), corpus_env["SHARDZOO_CACHE"]

    def load(src):
        return ["--load", str(root / src / "iter_0000003")]

    world4 = [(src, flags + ["--save", str(root / src), "--save-interval", "3"])
              for src, flags in SAVES.items()]
    world4 += [(f"{src}->ep2dp4zero", ["--ep", "2", "--use-distributed-optimizer"] + load(src))
               for src in SAVES]
    world4.append(("ep4->ep4", SAVES["ep4"] + load("ep4")))
    out = run_distributed(_train_runs, 4, world4, str(root), cache, timeout=900)[0]
    out.update(run_distributed(_train_runs, 1, [(f"{src}->ep1", load(src)) for src in SAVES],
                               str(root), cache, timeout=600)[0])
    out["root"] = str(root)
    return out


@pytest.mark.parametrize("src", list(SAVES))
def test_train_resume_at_other_expert_layouts(src, moe_train_runs):
    """train.py saved at iteration 3 of 6 at `src` (world 4) and resumed at (ep 1, world 1)
    and (ep 2, dp 4, ZeRO-1, world 4): losses 4..6 continue the uninterrupted run's (to the
    float32 bound of six steps' chains: other layouts sum in another order), and the
    expert biases, moved by integer load counts each step, end bitwise equal; resumed on
    its own layout (ep 4) the losses are bitwise the uninterrupted run's."""
    from tolerances import assert_losses_close, training_chain_terms

    runs = moe_train_runs
    ref = runs[src]
    k_step = training_chain_terms(TRAIN + SAVES[src])
    assert len(ref["losses"]) == 6 and ref["losses"][-1] < ref["losses"][0]
    for dst in ("ep1", "ep2dp4zero"):
        got = runs[f"{src}->{dst}"]
        assert len(got["losses"]) == 3, (dst, got["losses"])
        assert_losses_close(ref["losses"][:3] + got["losses"], ref["losses"], k_step,
                            what=f"{src} -> {dst} losses")
        assert got["biases"].keys() == ref["biases"].keys()
        for name, bias in ref["biases"].items():
            assert torch.equal(got["biases"][name], bias), (dst, name)
            assert bias.abs().sum() > 0  # it moved
    if src == "ep4":
        again = runs["ep4->ep4"]
        assert again["losses"] == ref["losses"][3:]  # bitwise
        assert all(torch.equal(again["biases"][n], b) for n, b in ref["biases"].items())
    meta = json.loads(Path(runs["root"], src, "iter_0000003", "metadata.json").read_text())
    assert (meta["layout"]["ep"], meta["layout"]["tp"]) == (int(SAVES[src][1]),
                                                             2 if "tp2" in src else 1)
