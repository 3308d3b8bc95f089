"""The planner's activation bytes of multi-head latent attention (planner/mla.py) against the
bytes a real training microbatch saves (training/memory.py's saved-tensor meter over the
decoder layers, as tests/test_recompute_memory.py measures standard attention).

tiny-deepseek (MLA with low-rank query, YaRN, a dense layer and three MoE layers) and
variants of its shape: no low-rank query, `v_head_dim` equal to the query/key head dim (SDPA's
fused kernel) and smaller than `qk_nope_head_dim`, a wider latent and RoPE part; micro batch 2,
32 and 48 tokens; no recompute, selective and full; dropout off and 0.1 (keyed by sample:
the explicit softmax); float32 and bf16 at tp 1, float32 at tp 2 with and without sequence
parallelism; and train.py's start-up measurement at cp 2 (ring and all-gather: q, k, v
zero-padded to one head dim). measured == predicted, to the byte.

Multi-token prediction (planner/mtp.py): tiny-deepseek with --mtp-num-layers 1 and 2, the last
stage's bytes outside the decoder layers (embedding, head, loss and the MTP depths) against the
meter's, at tp 1 (float32, bf16), tp 2 with and without SP and pp 2, without recompute,
selective, full and with dropout; the whole microbatch at cp 2 (train.py's start-up
measurement); tools/plan.py's MTP share.
"""
from __future__ import annotations

import pytest
import torch

from distributed import run_distributed

SHAPES = {  # name: ModelConfig changes to tiny-deepseek
    "tiny-deepseek": {},
    "no-q-lora": dict(q_lora_rank=None),
    "v-equals-qk": dict(v_head_dim=24),
    "small-v": dict(v_head_dim=8),
    "wide-latent": dict(kv_lora_rank=48, qk_rope_head_dim=16, kv_channels=32),
}
POLICIES = [(None, None, None), ("selective", None, None), ("full", "uniform", 1)]


def _measure(shape: str, policy, dropout: float, s: int = 32, b: int = 2, sp: bool = False,
             dtype=torch.float32) -> tuple[int, int]:
    """(measured, predicted) bytes of the decoder layers for one microbatch."""
    from layers.recompute import apply_recompute
    from models import GPTModel
    from parallel_state import get_tensor_model_parallel_world_size
    from planner.activations import model_chunk_bytes
    from training.arguments import load_model_config
    from training.memory import measure_activation_bytes

    cfg = load_model_config("tiny-deepseek")
    for k, v in SHAPES[shape].items():
        setattr(cfg, k, v)
    cfg.hidden_dropout = cfg.attention_dropout = dropout
    cfg.vocab_size, cfg.seq_length = 256, s
    model = GPTModel(cfg, sequence_parallel=sp)
    model.init_weights(7)
    apply_recompute(model, *policy)
    model = model.to(dtype).train()
    ids = torch.randint(0, 256, (b, s), generator=torch.Generator().manual_seed(1))
    batch = {"tokens": ids, "labels": ids, "loss_mask": torch.ones(b, s),
             "sample_ids": torch.arange(b)}
    got = measure_activation_bytes([model], batch, None, dtype=dtype)
    predicted = model_chunk_bytes(model.config, got["num_layers"], s, b,
                                  get_tensor_model_parallel_world_size(),
                                  model.sequence_parallel, *policy,
                                  bytes_per_value=dtype.itemsize, keyed_dropout=True)
    return got["layers"], predicted


def _table(dtypes, seqs=(32,), sp=False) -> dict:
    return {(shape, policy[0], dropout, str(dtype), s): _measure(shape, policy, dropout, s=s,
                                                                  sp=sp, dtype=dtype)
            for shape in SHAPES for policy in POLICIES for dropout in (0.0, 0.1)
            for dtype in dtypes for s in seqs}


def _assert_exact(rows: dict, what: str) -> None:
    wrong = {k: v for k, v in rows.items() if v[0] != v[1]}
    assert not wrong, f"{what}: (measured, predicted) differ at {wrong}"
    assert len({v[0] for v in rows.values()}) > len(rows) // 2  # the cases do differ


def test_mla_activation_bytes_at_tp1(no_grid):
    rows = _table((torch.float32, torch.bfloat16), seqs=(32, 48))
    _assert_exact(rows, "tp 1")
    none, sel = rows[("tiny-deepseek", None, 0.0, "torch.float32", 32)][0], \
        rows[("tiny-deepseek", "selective", 0.0, "torch.float32", 32)][0]
    print(f"tiny-deepseek s 32 b 2 float32: {none} B without recompute, {sel} B selective")


def _tp2_tables():
    return {"tp": _table((torch.float32,)), "sp": _table((torch.float32,), sp=True)}


def test_mla_activation_bytes_at_tp2_with_and_without_sequence_parallel():
    for rank, tables in enumerate(run_distributed(_tp2_tables, 2, tp=2, timeout=600)):
        for name, rows in tables.items():
            _assert_exact(rows, f"rank {rank} tp 2 {name}")
        assert all(tables["sp"][k][0] < v[0] for k, v in tables["tp"].items()
                   if k[1] != "full"), "sequence parallelism shards the latents' rows"


def _startup_activations(runs: list[list[str]], log_dir: str, cache: str,
                         keys=("activation_bytes_layers", "activation_bytes_layers_predicted")
                         ) -> list[tuple]:
    """(measured, predicted) `keys` of train.py's start-up record of each run in `runs`."""
    import os

    import parallel_state as ps
    from training.arguments import parse_config
    from training.metrics import read_records
    from training.trainer import pretrain

    os.environ["SHARDZOO_CACHE"] = cache
    out = []
    for i, args in enumerate(runs):
        ps.destroy_model_parallel()
        pretrain(parse_config(args + ["--log-dir", f"{log_dir}/{i}"]))
        start = next(r for r in read_records(f"{log_dir}/{i}") if keys[1] in r)
        out.append((start[keys[0]], start[keys[1]]))
    return out


CP_RUNS = [["--cp", "2"], ["--cp", "2", "--cp-comm-type", "all_gather"],
           ["--cp", "2", "--recompute-granularity", "selective"]]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_mla_activation_bytes_at_cp2(corpus_env, tmp_path, dropout):
    base = ["--config", "configs/tiny-llama.yaml", "--model", "tiny-deepseek",
            "--peak-tflops", "1", "--train-iters", "1", "--lr-warmup-iters", "0",
            "--log-interval", "1", "--eval-interval", "0", "--micro-batch-size", "2", "--global-batch-size", "2",
            "--no-tensorboard", "--hidden-dropout", str(dropout), "--attention-dropout",
            str(dropout)]
    runs = run_distributed(_startup_activations, 2, [base + f for f in CP_RUNS],
                           str(tmp_path), corpus_env["SHARDZOO_CACHE"], timeout=600)[0]
    for flags, (measured, predicted) in zip(CP_RUNS, runs, strict=True):
        print(f"tiny-deepseek {flags} dropout {dropout}: measured {measured} B, "
              f"predicted {predicted} B")
        assert measured == predicted, (flags, measured, predicted)


# ------------------------------------------ multi-token prediction (planner/mtp.py)
MTP = ["--config", "configs/tiny-llama.yaml", "--model", "tiny-deepseek", "--num-layers", "2",
       "--moe-layer-freq", "0,1", "--seq-length", "32", "--micro-batch-size", "2",
       "--global-batch-size", "2", "--no-tensorboard", "--peak-tflops", "1"]
MTP_CASES = [f"--mtp-num-layers {d}{extra}" for d in (1, 2)
             for extra in ("", " --recompute-granularity selective",
                           " --recompute-granularity full",
                           " --hidden-dropout 0.1 --attention-dropout 0.1")]


def _mtp_rows(layout: list[str], dtypes=("fp32",)) -> dict:
    """(case, dtype) -> (measured, predicted) bytes of the last stage's chunk for one
    microbatch, by region ("other": embedding, head, loss and the MTP depths) and the
    predicted MTP share, under the grid this process holds (`layout`: its flags)."""
    import parallel_state as ps
    from layers.recompute import apply_recompute
    from models import GPTModel
    from models.pipeline import build_model_chunks
    from planner.memory import chunk_activation_bytes
    from planner.parameters import rank_chunks
    from training.arguments import parse_config
    from training.memory import measure_activation_bytes

    grid = ps.model_parallel_is_initialized()
    world = torch.distributed.get_world_size() if grid else 1
    pp_rank = ps.get_pipeline_model_parallel_rank() if grid else 0
    out = {}
    for case in MTP_CASES + ["--mtp-num-layers 0"]:
        for dtype in dtypes:
            config = parse_config(MTP + layout + case.split() + (["--bf16"] if dtype == "bf16"
                                                                  else []))
            config.validate(world)
            m, t = config.model, config.train
            ps.model_parallel_seed(11, 0, dropout_masks="sample")
            chunk = build_model_chunks(GPTModel, m, config.stage_num_layers(), pp_rank, None,
                                       sequence_parallel=t.sequence_parallel)[0]
            chunk.init_weights(7)
            apply_recompute(chunk, t.recompute_granularity, t.recompute_method,
                            t.recompute_num_layers)
            torch_dtype = torch.bfloat16 if t.bf16 else torch.float32
            chunk = chunk.to(torch_dtype).train()
            ids = torch.randint(0, m.vocab_size, (2, 32),
                                generator=torch.Generator().manual_seed(1))
            batch = {"tokens": ids, "labels": ids, "loss_mask": torch.ones(2, 32),
                     "sample_ids": torch.arange(2)}
            tp = t.tensor_model_parallel_size
            rows = 32 // tp if t.sequence_parallel else 32
            got = measure_activation_bytes([chunk], batch, (rows, 2, m.hidden_size),
                                           dtype=torch_dtype)
            want = chunk_activation_bytes(config, rank_chunks(config, pp_rank, base=True)[0],
                                          chunk.pre_process, chunk.post_process)
            out[(case, dtype)] = ((got["layers"], got["total"] - got["layers"]),
                                  (want["layers"], want["other"]), want["mtp"])
    return out


def _assert_mtp(rows: dict, what: str) -> None:
    wrong = {k: v[:2] for k, v in rows.items() if v[0] != v[1]}
    assert not wrong, f"{what}: ((layers, other) measured, predicted) differ at {wrong}"
    for (case, dtype), (measured, _, mtp) in rows.items():
        print(f"{what} {case} {dtype}: other measured {measured[1]} B = predicted, of which "
              f"MTP {mtp} B")
    depths = {d: rows[(f"--mtp-num-layers {d}", "fp32")] for d in (0, 1, 2)}
    assert depths[0][2] == 0 < depths[1][2] and depths[2][2] == 2 * depths[1][2]
    assert depths[2][0][1] - depths[1][0][1] == depths[1][2]  # each depth, as measured


def test_mtp_activation_bytes_at_tp1(no_grid):
    """tiny-deepseek with --mtp-num-layers 1 and 2 (its MTP layer an MoE layer, as the last
    one): the last stage's bytes outside the decoder layers (embedding, final norm, head,
    loss and the MTP depths) measured == predicted, float32 and bf16, without recompute,
    selective and full (the MTP layer is never recomputed), dropout 0.1."""
    _assert_mtp(_mtp_rows([], ("fp32", "bf16")), "tp 1")


def _mtp_worlds(layouts: list[list[str]]) -> list[dict]:
    return [_mtp_rows(layout) for layout in layouts]


def test_mtp_activation_bytes_at_tp2_with_and_without_sp():
    layouts = [["--tp", "2"], ["--tp", "2", "--sequence-parallel"]]
    for rank, tables in enumerate(run_distributed(_mtp_worlds, 2, layouts, tp=2,
                                                  timeout=600)):
        for layout, rows in zip(layouts, tables, strict=True):
            _assert_mtp(rows, f"rank {rank} {' '.join(layout)}")


def test_mtp_activation_bytes_on_the_last_pipeline_stage():
    """pp 2: the MTP depths sit on stage 1 (with their own copy of the word embedding);
    stage 0's prediction has no MTP share."""
    first, last = run_distributed(_mtp_worlds, 2, [["--pp", "2"]], pp=2, timeout=600)
    _assert_mtp(last[0], "pp 2 stage 1")
    wrong = {k: v[:2] for k, v in first[0].items() if v[0] != v[1] or v[2]}
    assert not wrong, f"pp 2 stage 0: {wrong}"


def test_plan_prints_the_mtp_share(capsys, tmp_path):
    """tools/plan.py on a tiny-deepseek run file with --mtp-num-layers 2: every fitting
    layout's last-stage MTP share is planner/mtp.py's for its tp, SP and micro batch (float32:
    the run file has no --bf16), and the paragraph on the top choice says it."""
    import json

    from planner.mtp import mtp_activation_bytes
    from test_planner import _plan
    from training.arguments import parse_config

    run = tmp_path / "mtp.yaml"
    run.write_text("model: tiny-deepseek\nnum_layers: 2\nmoe_layer_freq: [0, 1]\n"
                   "mtp_num_layers: 2\nseq_length: 32\n")
    argv = ["--config", str(run), "--gpus", "2", "--gpu-memory", "2GB",
            "--global-batch-size", "8"]
    code, out, _ = _plan(capsys, *argv, "--json")
    assert code == 0
    model = parse_config(["--config", str(run)]).model
    fits = json.loads(out)["fits"]
    for p in fits:
        want = sum(mtp_activation_bytes(model, 32, p["micro_batch_size"], p["tp"],
                                        p["sequence_parallel"], 4, ep=p["ep"]).values())
        assert p["memory"]["last_stage_mtp_per_microbatch"] == want, p["flags"]
    code, out, _ = _plan(capsys, *argv, "--top", "1")
    share = fits[0]["memory"]["last_stage_mtp_per_microbatch"]
    assert code == 0 and f"Multi-token prediction (--mtp-num-layers) adds {share / 1e9:.3g} " \
        f"GB of activations per microbatch on the last stage" in out, out


def test_mtp_activation_bytes_at_cp2(corpus_env, tmp_path):
    """train.py's start-up measurement at cp 2 (the depths' shifted tokens, labels and loss
    masks split with the sequence; the MTP layer's attention layers/context_parallel's):
    the whole microbatch's bytes measured == the planner's, --mtp-num-layers 0, 1 and 2."""
    base = MTP + ["--train-iters", "1", "--lr-warmup-iters", "0", "--log-interval", "1",
                  "--eval-interval", "0", "--cp", "2"]
    runs = [base + ["--mtp-num-layers", str(d)] for d in (0, 1, 2)]
    got = run_distributed(_startup_activations, 2, runs, str(tmp_path),
                          corpus_env["SHARDZOO_CACHE"], ("activation_bytes_per_microbatch",
                                                        "planner_activation_bytes_per_microbatch"),
                          timeout=600)
    for rank, rows in enumerate(got):
        for d, (measured, predicted) in enumerate(rows):
            print(f"cp 2 rank {rank} --mtp-num-layers {d}: measured {measured} B, "
                  f"predicted {predicted} B")
            assert measured == predicted, (rank, d, measured, predicted)
