"""Multi-token prediction (models/mtp.py; DeepSeek-V3 report sec. 2.2, eq. 21-25):

- a dense float64 reference of eq. 21-25 written here (float32 cross entropy, as the
  model's) gives the module's gradient (main loss
  + lambda / D x the depths' mean losses), while the returned loss is the main loss exactly,
  and the depths' logged losses;
- training a two-layer tiny DeepSeek-V3 with one MTP depth and dropout 0.1 gives the one
  process's losses, gradient norms and `mtp_1` losses at tp 2 with sequence parallelism,
  pp 2 (the last stage's embedding copy), ep 2, dp 2 with ZeRO-3 and cp 2 (ring and
  all-gather attention; keyed attention and hidden dropout on: the depths' shifts made on
  the whole sequence before the CP split), all in one spawned world; a checkpoint saved at
  pp 2 resumes at tp 2 + SP with the uninterrupted losses;
- HF DeepseekV3ForCausalLM with num_nextn_predict_layers 1 round-trips bitwise (tied and
  untied); the planner lists the MTP parameters as the model holds them.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import parallel_state as ps
from distributed import run_distributed
from tolerances import assert_losses_close, training_chain_terms

TINY = ["--config", "configs/tiny-llama.yaml", "--model", "tiny-deepseek", "--num-layers", "2",
        "--moe-layer-freq", "0,1", "--mtp-num-layers", "1", "--seq-length", "32",
        "--train-iters", "3", "--log-interval", "1", "--eval-interval", "0",
        "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--no-tensorboard", "--peak-tflops", "1"]
LAYOUTS = [["--tp", "2", "--sequence-parallel"], ["--pp", "2"],
           ["--expert-model-parallel-size", "2"],
           ["--data-parallel-sharding-strategy", "optim_grads_params"],
           ["--context-parallel-size", "2"],
           ["--context-parallel-size", "2", "--cp-comm-type", "all_gather"]]


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference_objective(model, ids, labels, factor):
    """Eq. 21-25 written out on the model's weights (its layers as TRM_k): the main mean
    loss + lambda / D sum_k L^k, L^k the mean over the b x s tokens (the schedule's 1 /
    tokens), with [embedding; hidden] into eh_proj (the checkpoints' order)."""
    c, (b, s) = model.config, ids.shape
    rotary = model.rotary(s, 0, device=ids.device)
    h = model.decoder(model.embedding(ids), rotary=rotary)  # h^0 [s, b, h], final norm applied
    w_out = model.output_weight()[:c.vocab_size]  # without the padding rows
    emb = model.embedding.word_embeddings.weight
    total = F.cross_entropy((h @ w_out.t()).reshape(-1, w_out.shape[0]),
                            labels.t().reshape(-1), reduction="sum") / (b * s)
    depth_means = []
    for k, layer in enumerate(model.mtp.layers.values(), start=1):
        nxt = emb[ids[:, k:]].transpose(0, 1)  # Emb(t_{i+k}) [s-k, b, h]
        cat = torch.cat([_rms(nxt, layer.enorm.weight, c.layernorm_epsilon),
                         _rms(h[:s - k], layer.hnorm.weight, c.layernorm_epsilon)], -1)
        full = torch.zeros(s, b, cat.shape[-1], dtype=cat.dtype)
        full[:s - k] = cat  # positions past T-k: the module's padding, never a target
        h = layer.final_layernorm(layer.transformer_layer(layer.eh_proj(full), rotary=rotary))
        logits = (h[:s - k] @ w_out.t()).reshape(-1, w_out.shape[0])
        ce = F.cross_entropy(logits, labels[:, k:].t().reshape(-1), reduction="sum")
        depth_means.append(ce / (b * s))
        total = total + factor / len(model.mtp.layers) * ce / (b * s)
    return total, depth_means


def test_module_matches_dense_float64_reference_of_eq_21_to_25(no_grid):
    from models import GPTModel
    from models.mtp import mtp_shifted
    from training.arguments import load_model_config

    c = dataclasses.replace(load_model_config("tiny-deepseek"), mtp_num_layers=2,
                            mtp_loss_scaling_factor=0.3, vocab_size=96, num_layers=2,
                            moe_layer_freq=[0, 1])
    torch.manual_seed(0)
    model = GPTModel(c).double().train()
    model.init_weights(7)
    ids = torch.randint(0, 96, (2, 12))
    labels = torch.randint(0, 96, (2, 12))
    out = model(ids, labels=labels)
    plain = GPTModel(c).double().eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():  # the main loss alone, without the MTP path (eval runs none)
        main = plain(ids, labels=labels)
    assert torch.equal(out.detach(), main), "the returned loss must be the main loss exactly"
    term = model.mtp.objective(mtp_shifted(torch.ones(2, 12), 2, 0))  # the schedule's term
    assert term.item() == 0.0, "the MTP term's value must be 0 exactly"
    (out.sum() + term).div(ids.numel()).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref, depth_means = _reference_objective(model, ids, labels, 0.3)
    ref.backward()
    for n, p in model.named_parameters():  # the cross entropy runs in float32
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-5 * p.grad.abs().max(),
                                   msg=n)
    assert got["mtp.layers.1.eh_proj.weight"].abs().sum() > 0
    # the log's sums (`objective` added them): each depth's losses over the tokens
    torch.testing.assert_close(model.mtp.loss_sums / ids.numel(),
                               torch.stack(depth_means).detach(), rtol=1e-6, atol=0)


def test_shifts_before_the_cp_split_hold_each_positions_next_tokens():
    """A CP rank's part of the depths' shifts (made on the whole sequence, then split) holds
    at each of its positions p the token p + k of the whole sequence, across its chunks'
    ends (where a shift of its own part would read its next chunk or nothing)."""
    from layers.context_parallel import local_positions, split_for_context_parallel
    from models.mtp import mtp_shifted

    ids = torch.arange(100, 116).repeat(2, 1)  # [b 2, s 16]: the id of position p is 100 + p
    for rank in range(2):
        part = split_for_context_parallel(mtp_shifted(ids, 3, 0), 2, 2, rank)  # [2, 3, 8]
        for k in range(1, 4):
            want = [100 + p + k if p + k < 16 else 0 for p in local_positions(16, 2, rank)]
            assert part[0, k - 1].tolist() == want, (rank, k)


def _runs(argvs: list[list[str]], log_dir: str, cache: str) -> list[dict]:
    """pretrain() once per argument list in this world: rank 0's {loss, grad_norm, mtp}."""
    import os

    from training.arguments import parse_config
    from training.trainer import pretrain

    os.environ["SHARDZOO_CACHE"] = cache
    out = []
    for i, args in enumerate(argvs):
        ps.destroy_model_parallel()
        records = [r for r in pretrain(parse_config(args + ["--log-dir", f"{log_dir}/{i}"]))
                   if "loss" in r and "grad_norm" in r]
        out.append({key: [r[name] for r in records] for key, name in (
            ("loss", "loss"), ("grad_norm", "grad_norm"), ("mtp", "mtp_1_loss"))})
    return out


@pytest.fixture(scope="module")
def runs(corpus_env, tmp_path_factory):
    cache, root = corpus_env["SHARDZOO_CACHE"], tmp_path_factory.mktemp("mtp")
    ckpt = str(root / "ckpt")
    one = run_distributed(_runs, 1, [TINY], str(root / "one"), cache, timeout=600)[0]
    two = [TINY + f for f in LAYOUTS] + [
        TINY + ["--pp", "2", "--train-iters", "2", "--save", ckpt, "--save-interval", "2"],
        TINY + ["--tp", "2", "--sequence-parallel", "--load", ckpt]]
    return one[0], run_distributed(_runs, 2, two, str(root / "two"), cache, timeout=900)[0]


@pytest.mark.parametrize("i", range(len(LAYOUTS)), ids=[" ".join(f) for f in LAYOUTS])
def test_training_loss_equals_one_process_at_every_layout(runs, i):
    ref, got = runs[0], runs[1][i]
    assert ref["loss"][-1] < ref["loss"][0], ref  # it learns
    k = training_chain_terms(TINY + LAYOUTS[i])
    print(f"{LAYOUTS[i]}: loss diffs {[a - b for a, b in zip(got['loss'], ref['loss'])]}, "
          f"mtp_1 diffs {[a - b for a, b in zip(got['mtp'], ref['mtp'])]}, grad norm "
          f"diffs {[a - b for a, b in zip(got['grad_norm'], ref['grad_norm'])]}")
    for key in ("loss", "grad_norm", "mtp"):
        assert_losses_close(got[key], ref[key], k, f"{key} at {LAYOUTS[i]}")


def test_checkpoint_resumes_at_another_layout(runs):
    ref, saved, resumed = runs[0], runs[1][-2], runs[1][-1]
    k = training_chain_terms(TINY)
    assert_losses_close(saved["loss"], ref["loss"][:2], k, "losses before the save")
    for key in ("loss", "mtp"):  # the MTP weights came back, not their initial values
        assert len(resumed[key]) == 1, resumed
        assert_losses_close(resumed[key], ref[key][2:], 3 * k, f"{key} after resuming")


def _hf_with_mtp(folder, tie: bool) -> None:
    """transformers' tiny random DeepseekV3ForCausalLM of 2 layers + 1 MTP depth in `folder`:
    built with 3 decoder layers (the third is the MTP layer's decoder part), then given the
    MTP tensors (random enorm, hnorm, eh_proj, shared_head.norm; copies of the embedding and
    head) and num_hidden_layers 2, num_nextn_predict_layers 1, as DeepSeek's files are."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    cfg = DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, q_lora_rank=24, num_hidden_layers=3, first_k_dense_replace=1,
        n_group=2, topk_group=1, routed_scaling_factor=2.5, initializer_range=0.2,
        tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    tensors = load_file(f"{folder}/model.safetensors")
    g = torch.Generator().manual_seed(4)
    for name, shape in (("enorm", [64]), ("hnorm", [64]), ("eh_proj", [64, 128]),
                        ("shared_head.norm", [64])):
        tensors[f"model.layers.2.{name}.weight"] = torch.randn(shape, generator=g)
    tensors["model.layers.2.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    tensors["model.layers.2.shared_head.head.weight"] = tensors[
        "model.embed_tokens.weight" if tie else "lm_head.weight"]
    save_file({k: v.contiguous().clone() for k, v in tensors.items()},
              f"{folder}/model.safetensors", metadata={"format": "pt"})
    d = json.load(open(f"{folder}/config.json"))
    d.update(num_hidden_layers=2, num_nextn_predict_layers=1)
    json.dump(d, open(f"{folder}/config.json", "w"))


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_hf_round_trip_with_the_mtp_layer_is_bitwise(tmp_path, tie):
    import warnings

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from checkpoint.format import read_metadata
    from checkpoint.hf import export_hf, import_hf
    from models.hf import HFConversionError

    hf = tmp_path / "hf"
    _hf_with_mtp(hf, tie)
    import_hf(str(hf), str(tmp_path / "ckpt"), log=lambda *a: None)
    assert read_metadata(str(tmp_path / "ckpt"))["model"]["mtp_num_layers"] == 1
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"), log=lambda *a: None)
    original, back = load_file(f"{hf}/model.safetensors"), load_file(
        f"{tmp_path}/out/model.safetensors")
    assert set(back) == set(original), sorted(set(back) ^ set(original))
    for key, t in back.items():
        assert torch.equal(t, original[key]), f"{key} differs after the round trip"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"),
                                                       output_loading_info=True)
    # transformers builds no MTP layer: its tensors are all it leaves unused
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert info["unexpected_keys"] and all(k.startswith("model.layers.2.")
                                           for k in info["unexpected_keys"])
    # a copy of the embedding that differs from it is refused, not dropped
    original["model.layers.2.embed_tokens.weight"] = \
        original["model.layers.2.embed_tokens.weight"] + 1
    save_file(original, f"{hf}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFConversionError, match="embed_tokens.weight differs"):
        import_hf(str(hf), str(tmp_path / "ckpt2"), log=lambda *a: None)


@pytest.mark.parametrize("pre_process", [True, False], ids=["one-stage", "last-stage"])
def test_planner_lists_the_mtp_parameters(no_grid, pre_process):
    """planner/parameters.py's list of a chunk with MTP is the model's, names and sizes (the
    last stage's embedding copy included), and the FLOPs count one more layer and head."""
    from models import GPTModel
    from planner.flops import forward_flops_per_token
    from planner.parameters import chunk_parameters
    from training.arguments import load_model_config

    c = dataclasses.replace(load_model_config("tiny-deepseek"), mtp_num_layers=2)
    with torch.device("meta"):
        model = GPTModel(c, pre_process=pre_process, layer_numbers=[3])
    ours = [(n, p.numel()) for n, p in model.named_parameters()]
    planned = [(p.name, p.numel()) for p in chunk_parameters(c, 1, [3], pre_process, True, False)]
    assert planned == ours
    plain = dataclasses.replace(c, mtp_num_layers=None)
    assert forward_flops_per_token(c) > forward_flops_per_token(plain) * 1.3
