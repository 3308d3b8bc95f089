"""Sharded generation against transformers' `generate` (tiny random GPT-2 and Llama-GQA models).

One spawned world of 4 ranks rebuilds the grid for every layout (tp=1, tp=2, tp=4 with KV
heads replicated, pp=2, tp=2 x pp=2) and generates the same requests; the parent compares:
- greedy ids equal HF generate token for token, each prompt generated alone, for prompts of
  unequal length with fewer cache slots than requests (rows join and leave mid-batch);
- per-row EOS stops exactly where HF stops;
- padded-vocab logits forced to +1e4 never produce a padding id;
- seeded sampling (temperature, top-k, top-p) is identical at every layout;
- at pp=2 two micro-batches are in flight at once (default num_micro_batches = pp) and the
  ids equal pp=1 and one micro-batch at a time;
- logprobs (greedy and sampled rows, some without) equal a direct log_softmax of HF's logits
  for the same ids, identical on every rank;
- the paged KV cache at blocks of 4 with prefix caching (prompts sharing a prefix, run twice:
  the second pass hits), chunked prefill (4-token chunks) and preemption (a 6-block cache)
  gives HF's greedy ids at every layout, and every block is free afterwards;
- prompt_logprobs (the Llama): each prompt token's logprob, rank and top N equal HF's
  log_softmax of the prompt's logits at every layout, scored in 4-token chunks beside rows
  that did not ask, with prefix caching on (a repeated prompt still scores every token), the
  greedy ids unchanged.
"""
from __future__ import annotations

import pytest
import torch

from distributed import run_distributed

PROMPTS = [[5, 17, 99, 3, 42], [7, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11], [300, 200, 100]]
MAX_NEW = [4, 9, 6]
LAYOUTS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)]  # (tp, pp)
# SamplingParams.logprobs per prompt: greedy rows, sampled rows (None: not asked)
LOGPROBS = {"greedy": [2, None, 0], "sampled": [3, 20, None]}
# the paged-cache checks: prompts sharing a 9-token prefix (two full blocks of 4), and others
SHARED = [[11, 12, 13, 14, 15, 16, 17, 18, 19] + s for s in ([20, 21], [30], [40, 41, 42])]
PAGED_PROMPTS, PAGED_NEW = SHARED + PROMPTS, 6


def _hf_configs() -> dict:
    from transformers import GPT2Config, LlamaConfig

    return {
        "gpt2": GPT2Config(vocab_size=1001, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                           initializer_range=0.5, bos_token_id=0, eos_token_id=0),
        "llama_gqa": LlamaConfig(vocab_size=1001, hidden_size=64, intermediate_size=96,
                                 num_hidden_layers=2, num_attention_heads=8,
                                 num_key_value_heads=2, max_position_embeddings=64,
                                 tie_word_embeddings=False, initializer_range=0.2),
    }


def random_hf_models(root, configs: dict, seed: int, adjust=None) -> dict:
    """name -> (hf folder, native checkpoint folder) of a random transformers model per
    config (torch seed `seed + i`), changed by `adjust(model)` (under no_grad) when given,
    saved under `root` and imported."""
    from checkpoint.hf import import_hf
    from transformers import AutoModelForCausalLM

    out = {}
    for i, (name, cfg) in enumerate(configs.items()):
        torch.manual_seed(seed + i)
        model = AutoModelForCausalLM.from_config(cfg)
        if adjust is not None:
            with torch.no_grad():
                adjust(model)
        hf_dir, ckpt = str(root / name), str(root / f"{name}-ckpt")
        model.save_pretrained(hf_dir)
        import_hf(hf_dir, ckpt, log=lambda *a: None)
        out[name] = (hf_dir, ckpt)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (hf folder, native checkpoint folder); large init std, so greedy outputs do
    not collapse into one repeated id."""
    return random_hf_models(tmp_path_factory.mktemp("infer"), _hf_configs(), 10)


def _hf_generate(hf_dir: str, prompt: list[int], max_new: int, eos: int | None) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _force_padding_logits(model) -> None:
    """Make every padded-vocab logit of the output layer +1e4 (a forward hook)."""
    import parallel_state as ps

    if not model.post_process:
        return
    per_rank = model.padded_vocab_size // ps.get_tensor_model_parallel_world_size()
    start = ps.get_tensor_model_parallel_rank() * per_rank
    ids = torch.arange(start, start + per_rank)
    pad = ids >= model.config.vocab_size

    def hook(_module, _inputs, out):
        return out.masked_fill(pad, 1e4)
    model.output_layer.register_forward_hook(hook)


def _generate(engine, reqs) -> list:
    """Run `reqs` step by step; the logprobs of each request's events, in request order (the
    events carry them exactly when the request asked, one entry per new id)."""
    for r in reqs:
        engine.add(r)
    got = {r.id: [] for r in reqs}
    asked = {r.id: r.params.logprobs for r in reqs}
    while engine.has_work():
        for e in engine.step():
            assert (e.logprobs is None) == (asked[e.id] is None), (e, asked[e.id])
            if e.logprobs is not None:
                assert [t for t, _, top in e.logprobs] == e.token_ids
                assert all(len(top) == asked[e.id] for _, _, top in e.logprobs)
                got[e.id] += e.logprobs
    return [got[r.id] for r in reqs]


def _run_layouts(models: dict, eos: dict) -> dict:
    """In a worker: {(name, tp, pp): {"greedy": [...], "sampled": [...]}} on global rank 0."""
    import parallel_state as ps
    from inference.engine import Engine, Request
    from inference.loading import load
    from inference.sampling import SamplingParams

    results = {}
    for tp, pp in LAYOUTS:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tp, pp, device="cpu")
        for name, (hf_dir, ckpt) in models.items():
            # the Llama loads from HF in memory, GPT-2 from the native checkpoint
            model, _, _ = load(hf=hf_dir) if name == "llama_gqa" else load(load=ckpt)
            _force_padding_logits(model)
            out = {}
            for kind, stop in (("greedy", ()), ("eos", (eos[name],))):
                engine = Engine(model, eos_token_ids=stop, max_batch_size=2, max_seq_length=32)
                reqs = [Request(str(i), p, SamplingParams(
                    max_new_tokens=n, logprobs=LOGPROBS["greedy"][i] if kind == "greedy" else
                    None)) for i, (p, n) in enumerate(zip(PROMPTS, MAX_NEW))]
                out[f"{kind}_logprobs"] = _generate(engine, reqs)
                out[kind] = [r.output for r in reqs]
                assert not engine.has_work() and engine.blocks.num_free == engine.blocks.capacity
                out[f"{kind}_in_flight"] = engine.max_in_flight
            engine = Engine(model, max_batch_size=4, max_seq_length=32)
            params = [SamplingParams(max_new_tokens=8, temperature=t, top_k=k, top_p=p, seed=s,
                                     logprobs=n)
                      for t, k, p, s, n in zip((1.0, 0.7, 1.3), (0, 20, 0), (1.0, 1.0, 0.9),
                                               (1, 2, 3), LOGPROBS["sampled"])]
            reqs = [Request(str(i), pr, sp) for i, (pr, sp) in enumerate(zip(PROMPTS, params))]
            out["sampled_logprobs"] = _generate(engine, reqs)
            out["sampled"] = [r.output for r in reqs]
            out["sampled_in_flight"] = engine.max_in_flight
            if pp > 1:  # one micro-batch at a time must give the same ids
                engine = Engine(model, max_batch_size=2, max_seq_length=32, num_micro_batches=1)
                reqs = [Request(str(i), p, SamplingParams(max_new_tokens=n))
                        for i, (p, n) in enumerate(zip(PROMPTS, MAX_NEW))]
                out["one_at_a_time"] = [r.output for r in engine.generate(reqs)]
                assert engine.max_in_flight == 1
            if name == "llama_gqa":
                out["paged"] = _paged_runs(model)
                out["prompt_logprobs"] = _prompt_logprobs_run(model)
            results[(name, tp, pp)] = out
        if (tp, pp) == (2, 2):  # T5 (encoder | decoder stages, each split over tp) vs HF
            from test_t5 import _greedy_matches_hf

            results[("t5", 2, 2)] = _greedy_matches_hf()
    return results


PROMPT_LOGPROBS = [2, 0, None, 3]  # per request of PROMPTS + [PROMPTS[1]] (None: not asked)


def _prompt_logprobs_run(model) -> dict:
    """PROMPTS and PROMPTS[1] again with PROMPT_LOGPROBS, blocks of 4 with prefix caching,
    prompts scored in chunks of 4: {"scored": each request's first-event prompt_logprobs,
    "outputs": ids}."""
    from inference.engine import Engine, Request
    from inference.sampling import SamplingParams

    engine = Engine(model, max_batch_size=3, max_seq_length=32, block_size=4)
    engine._score_chunk = lambda: 4
    reqs = [Request(str(i), p, SamplingParams(max_new_tokens=3, prompt_logprobs=k))
            for i, (p, k) in enumerate(zip(PROMPTS + [PROMPTS[1]], PROMPT_LOGPROBS))]
    scored = {}
    for r in reqs:
        engine.add(r)
    while engine.has_work():
        for e in engine.step():
            if len(e.token_ids) and e.completion_tokens == 1:
                scored[e.id] = e.prompt_logprobs
    return {"scored": [scored[r.id] for r in reqs], "outputs": [r.output for r in reqs]}


def _paged_runs(model) -> dict:
    """PAGED_PROMPTS twice through a cache of 6 blocks of 4 positions with 4-token prefill
    chunks (preemption needed, prefix hits on the second pass): {"outputs": [pass 1, pass 2],
    "stats": the engine's, "all_free": every block free at the end}."""
    from inference.engine import Engine, Request
    from inference.sampling import SamplingParams

    per_token = Engine(model, max_batch_size=1, max_seq_length=32).runner.bytes_per_token
    engine = Engine(model, max_batch_size=3, max_seq_length=32, block_size=4,
                    kv_cache_memory=7 * 4 * per_token, max_num_batched_tokens=4)
    assert engine.blocks.capacity == 6
    outputs = []
    for _ in range(2):
        reqs = [Request(str(i), p, SamplingParams(max_new_tokens=PAGED_NEW))
                for i, p in enumerate(PAGED_PROMPTS)]
        outputs.append([r.output for r in engine.generate(reqs)])
    return {"outputs": outputs, "stats": engine.stats(),
            "all_free": engine.blocks.num_free == engine.blocks.capacity}


def test_generation_matches_transformers_at_every_layout(models):
    """GPT-2 and Llama GQA at every layout; T5 v1.0 / v1.1 also at tp=2 x pp=2."""
    import torch.multiprocessing  # noqa: F401

    # EOS per model: a greedy token of prompt 1 first seen after its first token, so row 1
    # stops early
    ref = {name: [_hf_generate(hf, p, n, None) for p, n in zip(PROMPTS, MAX_NEW)]
           for name, (hf, _) in models.items()}
    eos = {name: next(t for j, t in enumerate(r[1]) if j and t not in r[1][:j])
           for name, r in ref.items()}
    ref_eos = {name: [_hf_generate(hf, p, n, eos[name]) for p, n in zip(PROMPTS, MAX_NEW)]
               for name, (hf, _) in models.items()}
    paged_ref = [_hf_generate(models["llama_gqa"][0], p, PAGED_NEW, None) for p in PAGED_PROMPTS]
    ranks = run_distributed(_run_layouts, 4, models, eos, timeout=400)
    results = ranks[0]
    for tp, pp in LAYOUTS:
        paged = results[("llama_gqa", tp, pp)]["paged"]
        where = f"paged cache tp={tp} pp={pp}"
        assert paged["outputs"] == [paged_ref, paged_ref], where
        assert paged["all_free"], where
        stats = paged["stats"]
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, (where, stats)
    for name in models:
        assert len(ref_eos[name][1]) < MAX_NEW[1] and ref_eos[name][1][-1] == eos[name]
        sampled0 = results[(name, 1, 1)]["sampled"]
        assert any(a != b for a, b in zip(sampled0[0], sampled0[1])) or sampled0[0] != ref[name][0]
        for tp, pp in LAYOUTS:
            got = results[(name, tp, pp)]
            where = f"{name} tp={tp} pp={pp}"
            assert got["greedy"] == ref[name], f"{where}: greedy differs from HF generate"
            assert got["eos"] == ref_eos[name], f"{where}: per-row EOS differs from HF"
            assert all(0 <= t < 1001 for row in got["sampled"] for t in row), where
            assert got["sampled"] == sampled0, f"{where}: seeded sampling differs from tp=1"
            assert [len(r) for r in got["sampled"]] == [8, 8, 8]
            # pp = 2: two micro-batches in flight (stages busy at once), same ids as pp = 1
            assert got["greedy_in_flight"] == got["eos_in_flight"] == pp, where
            assert got["sampled_in_flight"] == pp, where
            if pp > 1:
                assert got["one_at_a_time"] == ref[name], where
            for kind in LOGPROBS:  # every rank of the layout got rank 0's values
                assert all(r[(name, tp, pp)][f"{kind}_logprobs"] == got[f"{kind}_logprobs"]
                           for r in ranks), f"{where}: {kind} logprobs differ between ranks"
        worst = _check_logprobs(name, models[name], results)
        print(f"{name}: max |logprob - HF log_softmax| {worst:.3g}")
    worst = _check_prompt_logprobs(models["llama_gqa"], results, ranks, ref["llama_gqa"])
    print(f"llama_gqa prompt_logprobs: max |logprob - HF log_softmax| {worst:.3g}")
    for ours, hf in results[("t5", 2, 2)]:  # T5 v1.0 and v1.1 at tp=2 x pp=2
        assert ours == hf, ("t5 tp=2 pp=2", ours, hf)


def _check_logprobs(name: str, folders: tuple, results: dict) -> float:
    """Every layout's logprobs of `name` against log_softmax of HF's float32 logits for the
    same ids (the raw model output); the largest difference."""
    from transformers import AutoModelForCausalLM

    from checkpoint.format import read_metadata
    from models import ModelConfig
    from tolerances import assert_fp32_close, forward_chain_terms

    hf_dir, ckpt = folders
    cfg = ModelConfig.from_dict(read_metadata(ckpt)["model"])
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    worst = 0.0
    for kind, asked in LOGPROBS.items():
        for i, (prompt, n) in enumerate(zip(PROMPTS, asked)):
            output = results[(name, 1, 1)][kind][i]
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + output])).logits[0].float()
            logits = logits[len(prompt) - 1:len(prompt) - 1 + len(output)]
            ref = torch.log_softmax(logits, dim=-1)
            k = forward_chain_terms(cfg, len(prompt) + len(output))
            for tp, pp in LAYOUTS:
                got = results[(name, tp, pp)][f"{kind}_logprobs"][i]
                where = f"{name} tp={tp} pp={pp} {kind} row {i}"
                if n is None:
                    assert got == [], where
                    continue
                assert [t for t, _, _ in got] == output, where
                ours = torch.tensor([lp for _, lp, _ in got])
                want = ref.gather(1, torch.tensor(output)[:, None])[:, 0]
                shape = (len(got), n)
                top_ids = torch.tensor([[t for t, _ in top] for _, _, top in got]).view(shape)
                top = torch.tensor([[lp for _, lp in top] for _, _, top in got]).view(shape)
                # the top n are the n largest (ties may swap ids: each id's own value checked)
                assert_fp32_close(torch.cat([ours, top.flatten(), top.flatten()]),
                                  torch.cat([want, ref.gather(1, top_ids).flatten(),
                                             ref.topk(n, dim=-1).values.flatten()]), k,
                                  where, scale=float(logits.abs().max()))
                assert all(len(set(row)) == n for row in top_ids.tolist()), where
                worst = max(worst, float((ours - want).abs().max()), float(
                    (top - ref.gather(1, top_ids)).abs().max()) if n else 0.0)
    return worst


def _check_prompt_logprobs(folders: tuple, results: dict, ranks: list, greedy: list) -> float:
    """Every layout's prompt_logprobs against HF's log_softmax of each prompt's logits: the
    token's value, its rank and the top N (each id's own value and the N largest), the same
    on every rank, greedy ids as without scoring; the largest difference."""
    from transformers import AutoModelForCausalLM

    from checkpoint.format import read_metadata
    from models import ModelConfig
    from tolerances import assert_fp32_close, forward_chain_terms

    hf_dir, ckpt = folders
    cfg = ModelConfig.from_dict(read_metadata(ckpt)["model"])
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    prompts, worst = PROMPTS + [PROMPTS[1]], 0.0
    for tp, pp in LAYOUTS:
        got = results[("llama_gqa", tp, pp)]["prompt_logprobs"]
        where = f"prompt_logprobs tp={tp} pp={pp}"
        assert all(r[("llama_gqa", tp, pp)]["prompt_logprobs"] == got for r in ranks), where
        assert got["outputs"] == [g[:3] for g in greedy + [greedy[1]]], where
        for i, (prompt, n) in enumerate(zip(prompts, PROMPT_LOGPROBS)):
            entries = got["scored"][i]
            if n is None:
                assert entries is None, where
                continue
            assert entries[0] is None and len(entries) == len(prompt), where
            with torch.no_grad():
                logits = hf(torch.tensor([prompt])).logits[0, :-1].float()
            ref = torch.log_softmax(logits, -1)
            assert [e[0] for e in entries[1:]] == prompt[1:], where
            ours = torch.tensor([e[1] for e in entries[1:]])
            want = ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
            for row, w, e in zip(ref, want, entries[1:]):  # 1 + the ids more likely (ties
                lo, hi = int((row > w + 1e-4).sum()), int((row > w - 1e-4).sum())  # aside)
                assert lo + 1 <= e[2] <= hi + 1, (where, i, e[2], lo, hi)
            shape = (len(prompt) - 1, n)
            top_ids = torch.tensor([[t for t, _ in e[3]] for e in entries[1:]]).view(shape)
            top = torch.tensor([[lp for _, lp in e[3]] for e in entries[1:]]).view(shape)
            assert_fp32_close(torch.cat([ours, top.flatten(), top.flatten()]),
                              torch.cat([want, ref.gather(1, top_ids).flatten(),
                                         ref.topk(n, dim=-1).values.flatten()]),
                              forward_chain_terms(cfg, len(prompt)), where,
                              scale=float(logits.abs().max()))
            worst = max(worst, float((ours - want).abs().max()))
    return worst


def test_kv_replication_layout_and_refusals():
    """Shard/unshard of a replicated fused QKV weight round-trips and gives each rank its
    group's K/V; training refuses tp > num_query_groups, inference refuses a tp that fits
    neither way."""
    from layers import shard_tensor, unshard_tensors
    from models.config import ConfigError, ModelConfig

    groups, per_group, d, tp = 2, 4, 3, 4
    full = torch.arange(groups * (per_group + 2) * d * 5, dtype=torch.float32).view(-1, 5)
    param = torch.empty(0)
    param.tensor_model_parallel, param.partition_dim = True, 0
    param.kv_replicas, param.qkv_layout = tp // groups, (groups, per_group, d)
    shards = [shard_tensor(full, param, rank=r, size=tp) for r in range(tp)]
    blocks = full.view(groups, per_group + 2, d, 5)
    for r, s in enumerate(shards):
        s = s.view(per_group // 2 + 2, d, 5)
        g, half = divmod(r, 2)
        assert torch.equal(s[:2], blocks[g, 2 * half:2 * half + 2])  # its query heads
        assert torch.equal(s[2:], blocks[g, per_group:])  # its group's k, v
    assert torch.equal(unshard_tensors(shards, param), full)
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                      ffn_hidden_size=96, seq_length=32, max_position_embeddings=32,
                      vocab_size=100)
    with pytest.raises(ConfigError, match="inference only"):
        cfg.validate(4)
    cfg.validate(4, kv_replication=True)
    with pytest.raises(ConfigError, match="multiple"):
        ModelConfig(**{**cfg.to_dict(), "num_attention_heads": 12, "num_query_groups": 4,
                       "hidden_size": 96}).validate(6, kv_replication=True)


def test_torchrun_error_is_the_root_cause(tmp_path):
    """Under torchrun infer.py's one-line error is also the worker's elastic error file, so
    torchrun's failure summary shows it (as train.py's)."""
    import os
    import subprocess
    import sys

    from launch import REPO

    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
         "infer.py", "--load", str(tmp_path / "missing"), "--prompt", "hi"], cwd=REPO,
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    root = proc.stderr.split("Root Cause")[1]
    line = next(ln for ln in root.splitlines() if "traceback :" in ln)
    assert "traceback : infer.py: error: --load" in line and "no checkpoint there" in line, root


def test_load_without_a_checkpoint_names_the_fix(tmp_path, no_grid):
    """--load on a missing or empty folder: a CheckpointError saying what to pass (it was a
    TypeError from deep inside the reader)."""
    from checkpoint.format import CheckpointError
    from inference.loading import load

    for where in (tmp_path / "missing", tmp_path):
        with pytest.raises(CheckpointError, match="no checkpoint there.*train.py --save"):
            load(load=str(where))


@pytest.mark.parametrize("flags, lines, message", [
    (["--seed", str(2**70)], None, "--seed: seed must be a 64-bit signed integer"),
    (["--seed", str(2**63 - 1), "--prompt", "b"], None, "--seed"),  # prompt 1: seed + 1
    (["--temperature", "-1"], None, "--temperature: temperature must be in [0, 100]"),
    (["--top-p", "1.5"], None, "--top-p: top_p must be in (0, 1]"),
    ([], ['{"prompt": "a"}', '{"prompt": '], "--prompt-file line 2 is not valid JSON"),
    ([], ["", "  "], "holds no prompt"),
], ids=["seed", "seed-plus-i", "temperature", "top-p", "bad-jsonl", "empty-file"])
def test_cli_rejects_bad_flags_before_loading(tmp_path, capsys, flags, lines, message):
    """Bad sampling flags and prompt files are usage errors (exit 2, one line) raised while
    parsing, before any model is read (the checkpoint path here does not exist)."""
    import sys

    from launch import REPO

    sys.path.insert(0, str(REPO))  # a Path entry breaks inductor (os.pathsep.join)
    import infer

    argv = ["--load", str(tmp_path / "missing"), *flags]
    if lines is None:
        argv += ["--prompt", "a"]
    else:
        (tmp_path / "p.txt").write_text("\n".join(lines) + "\n")
        argv += ["--prompt-file", str(tmp_path / "p.txt")]
    with pytest.raises(SystemExit) as e:
        infer.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_max_model_len_is_vllms_name_for_max_seq_length():
    import infer

    for flag, value in (("--max-model-len", 48), ("--max-seq-length", 40)):
        args = infer.parse_args(["--hf", "x", flag, str(value), "--prompt", "a"])
        assert args.max_seq_length == value


def test_max_seq_length_beyond_the_model_is_an_error(tmp_path):
    """--max-seq-length past a decoder's max_position_embeddings: one error line naming the
    limit, exit 2 (it used to be cut down to the limit without a word)."""
    import os
    import subprocess
    import sys

    from launch import REPO
    from tests.test_server import _make_model

    _make_model(str(tmp_path / "tiny"))  # max_position_embeddings 64
    proc = subprocess.run(
        [sys.executable, "infer.py", "--hf", str(tmp_path / "tiny"), "--max-seq-length", "65",
         "--prompt", "hi"], cwd=REPO, capture_output=True, text=True, timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "infer.py: error: --max-seq-length 65 exceeds the model's max_position_embeddings " \
           "(64); pass at most 64" in proc.stderr, proc.stderr[-2000:]


def test_tp_the_heads_do_not_split_over_names_the_ones_they_do():
    from inference.loading import _check_experts, _check_tp
    from models.config import ConfigError, ModelConfig

    smol = ModelConfig(num_layers=2, hidden_size=72, num_attention_heads=9, num_query_groups=3,
                       ffn_hidden_size=144, seq_length=32, max_position_embeddings=32,
                       vocab_size=100)  # SmolLM2's heads: 9, 3 KV
    _check_tp(smol, 3)
    _check_tp(smol, 9)  # KV heads replicated
    with pytest.raises(ConfigError, match=r"^--tp 2 does not fit this model \(9 attention "
                                          r"heads, 3 KV heads; .*\); use --tp 1, 3, 9$"):
        _check_tp(smol, 2)
    # --enable-expert-parallel (ep = tp): the tp values offered fit the experts and the heads
    # (it offered [2, 3, 6] for 6 experts and 4 heads; --tp 3 and 6 are then refused)
    moe = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=128, seq_length=32, max_position_embeddings=32,
                      vocab_size=100, num_moe_experts=6, moe_ffn_hidden_size=32,
                      add_bias_linear=False)
    _check_experts(moe, 2)
    with pytest.raises(ConfigError, match=r"6 experts over the --tp 4 ranks, but 6 is not "
                                          r"divisible by 4; use a --tp in \[2\] or drop"):
        _check_experts(moe, 4)
