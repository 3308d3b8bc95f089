"""Multi-head latent attention (layers/mla.py) and the DeepSeek-V3 family (models/hf/deepseek.py):

- training the tiny-deepseek model (MLA with low-rank query, YaRN, group-limited sigmoid MoE
  with shared expert and expert bias) with hidden and attention dropout 0.1 gives the single
  process's losses and gradient norms at tp 2 with and without SP, pp 2, cp 2, and with
  selective and full recompute (float32 tolerance of tests/tolerances.py); its loss falls;
- transformers' tiny random DeepseekV3ForCausalLM (two forms: low-rank query, YaRN with
  mscale, interleaved RoPE weights, n_group 2, first layer dense; and a plain q_proj, default
  RoPE not interleaved, every layer MoE) imported gives its logits at tp 1 and tp 2, and
  at tp 2 x pp 2, ep 2 and ep 2 x tp 2 too, and
  exports back bitwise (transformers loads the export cleanly); infer.py's loader and the
  Engine (latent cache) generate transformers' greedy ids at tp 1 and 2;
- YaRN's frequencies and attention factor equal transformers', group-limited routing
  equals transformers' router;
- refusals: DeepSeek-V3 fields not built, a partial multi-token-prediction layer (the whole
  layer converts: tests/test_mtp.py), MLA config mistakes.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import warnings

import pytest
import torch

import parallel_state as ps
from distributed import run_distributed
from test_dropout import DROPOUT, _train
from tolerances import assert_fp32_close, assert_losses_close, forward_chain_terms, \
    training_chain_terms

VOCAB, B, S, NEW = 128, 2, 24, 20
PROMPTS = [[5, 17, 99, 3, 42, 8, 61, 2, 11, 50, 7, 30], [9, 64, 3, 120, 7]]
DEEPSEEK = ["--config", "configs/tiny-llama.yaml", "--model", "tiny-deepseek",
            "--peak-tflops", "1"] + DROPOUT
LAYOUTS = {1: [[], ["--recompute-granularity", "selective"], ["--recompute-granularity", "full"]],
           2: [["--tp", "2", "--sequence-parallel"], ["--tp", "2", "--no-sequence-parallel"],
               ["--pp", "2"], ["--context-parallel-size", "2"]]}


def _hf_configs() -> dict:
    from transformers import DeepseekV3Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8,
                  num_experts_per_tok=2, kv_lora_rank=16, qk_rope_head_dim=8,
                  qk_nope_head_dim=16, max_position_embeddings=256, initializer_range=0.2,
                  bos_token_id=None, eos_token_id=None)
    return {
        "yarn": DeepseekV3Config(
            num_hidden_layers=3, q_lora_rank=24, v_head_dim=12, n_group=2, topk_group=1,
            first_k_dense_replace=1, routed_scaling_factor=2.5, rope_interleave=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 16, "mscale": 1.0,
                             "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1},
            **common),
        "plain": DeepseekV3Config(
            num_hidden_layers=2, q_lora_rank=None, v_head_dim=20, n_group=1, topk_group=1,
            first_k_dense_replace=0, routed_scaling_factor=1.0, rope_interleave=False,
            n_shared_experts=2, tie_word_embeddings=True, **common)}


def save_hf_models(root) -> dict:
    """name -> folder of transformers' tiny random DeepseekV3ForCausalLM of each
    `_hf_configs()` form, saved under `root`."""
    from transformers import AutoModelForCausalLM

    out = {}
    for i, (name, cfg) in enumerate(_hf_configs().items()):
        torch.manual_seed(50 + i)
        model = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():  # random norms and expert biases, so a swapped one shows
            for pname, p in model.named_parameters():
                if p.dim() == 1:
                    p.normal_(1.0 if "norm" in pname else 0.0, 0.1)
            for bname, b in model.named_buffers():
                if bname.endswith("e_score_correction_bias"):
                    b.normal_(0.0, 0.1)
        out[name] = str(root / name)
        model.save_pretrained(out[name])
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (hf folder, native checkpoint folder)."""
    from checkpoint.hf import import_hf

    root, out = tmp_path_factory.mktemp("deepseek"), {}
    for name, hf_dir in save_hf_models(root).items():
        ckpt = str(root / f"{name}-ckpt")
        import_hf(hf_dir, ckpt, log=lambda *a: None)
        out[name] = (hf_dir, ckpt)
    return out


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(0))


def _config(ckpt: str):
    from checkpoint.format import read_metadata
    from models import ModelConfig

    return ModelConfig.from_dict(read_metadata(ckpt)["model"])


@functools.cache  # read once per model: every layout compares with the same tensor
def _hf_logits(hf_dir: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(_ids()).logits


def _logits(ckpts: dict) -> dict:
    """name -> full logits `[B, S, VOCAB]` of each checkpoint on this grid (gathered over TP)."""
    from checkpoint.model_io import load_model_weights
    from models import GPTModel

    out = {}
    for name, ckpt in ckpts.items():
        model = GPTModel(_config(ckpt)).eval()
        load_model_weights(ckpt, [model])
        with torch.no_grad():
            logits = model(_ids())
        out[name] = ps.gather_from_tensor_model_parallel_region(logits)[..., :VOCAB]
    return out


def _generate(hf_dirs: dict) -> dict:
    """name -> greedy ids of PROMPTS (one batch, rows of different lengths) through infer.py's
    loader (`--hf`) and the Engine on this grid."""
    from inference.engine import Engine, Request
    from inference.loading import load
    from inference.sampling import SamplingParams

    out = {}
    for name, hf_dir in hf_dirs.items():
        model, _, _ = load(hf=hf_dir)
        reqs = [Request(str(i), p, SamplingParams(max_new_tokens=NEW))
                for i, p in enumerate(PROMPTS)]
        Engine(model, max_batch_size=2, max_seq_length=64).generate(reqs)
        out[name] = [r.output for r in reqs]
    return out


def _world(ckpts: dict, hf_dirs: dict, runs: list, log_dir: str, cache: str):
    """This world's logits of the imported checkpoints, its Engine's greedy ids, then its
    training runs."""
    return _logits(ckpts), _generate(hf_dirs), _train(runs, log_dir, cache)[:-1]


@pytest.fixture(scope="module")
def worlds(models, tmp_path_factory, corpus_env):
    ckpts = {name: ckpt for name, (_, ckpt) in models.items()}
    hf_dirs = {name: hf_dir for name, (hf_dir, _) in models.items()}
    cache, out = corpus_env["SHARDZOO_CACHE"], {}
    for world, flags in LAYOUTS.items():
        out[world] = run_distributed(
            _world, world, ckpts, hf_dirs, [DEEPSEEK + f for f in flags],
            str(tmp_path_factory.mktemp("mla")), cache, tp=world, timeout=900)[0]
    return out


def _layout_logits(ckpts: dict, hf_dirs: dict) -> dict:
    """On 4 processes: {layout: {name: (full logits, HF and checkpoint loads equal, this
    rank's (experts, fc1 rows) of the first MoE layer)}} (only on a last pipeline stage)
    at tp 2 x pp 2 (the imported checkpoint), ep 2 and ep 2 x tp 2 (loaded from the HF folder
    and from the checkpoint)."""
    from test_hf_conversion import pipeline_logits
    from test_hf_moe_families import _grid, _local_experts

    from checkpoint.hf import load_hf_weights
    from checkpoint.model_io import load_model_weights
    from models import GPTModel
    from models.hf import open_checked
    from models.pipeline import build_model_chunks

    out = {"tp2pp2": {}, "ep2": {}, "ep2tp2": {}}
    _grid(2, 2)
    for name, ckpt in ckpts.items():
        c = _config(ckpt)
        stages = [c.num_layers - c.num_layers // 2, c.num_layers // 2]
        chunks = build_model_chunks(GPTModel, c, stages, ps.get_pipeline_model_parallel_rank(),
                                    None)
        load_model_weights(ckpt, chunks)
        with torch.no_grad():
            logits = pipeline_logits(chunks[0], _ids())
        if logits is not None:
            out["tp2pp2"][name] = (logits, True, None)
    for layout, (tp, ep) in {"ep2": (1, 2), "ep2tp2": (2, 2)}.items():
        _grid(tp, ep=ep)
        for name, hf_dir in hf_dirs.items():
            src, c = open_checked(hf_dir)
            from_hf, from_ckpt = GPTModel(c).eval(), GPTModel(c)
            load_hf_weights(src, c, [from_hf])
            load_model_weights(ckpts[name], [from_ckpt])
            same = all(torch.equal(a, b) for a, b in zip(from_hf.parameters(),
                                                          from_ckpt.parameters()))
            with torch.no_grad():
                logits = ps.gather_from_tensor_model_parallel_region(from_hf(_ids()))
            out[layout][name] = (logits[..., :VOCAB], same, _local_experts(from_hf))
    return out


@pytest.fixture(scope="module")
def layouts(models):
    ckpts = {name: ckpt for name, (_, ckpt) in models.items()}
    hf_dirs = {name: hf_dir for name, (hf_dir, _) in models.items()}
    merged = {}
    for rank in run_distributed(_layout_logits, 4, ckpts, hf_dirs, timeout=600):
        for layout, by_name in rank.items():
            merged.setdefault(layout, {}).update(by_name)
    return merged


@pytest.mark.parametrize("layout", ["tp2pp2", "ep2", "ep2tp2"])
def test_logits_match_transformers_at_pp_and_ep_layouts(models, layouts, layout):
    """tp 2 x pp 2 from the imported checkpoint; ep 2 and ep 2 x tp 2 (half the routed
    experts a rank, whole or TP-split) from the HF folder, equal to the checkpoint's load."""
    assert set(layouts[layout]) == set(models)
    for name, (logits, same, experts) in layouts[layout].items():
        hf_dir, ckpt = models[name]
        c, ref = _config(ckpt), _hf_logits(hf_dir)
        print(f"{name} {layout}: max |logit - transformers| {(logits - ref).abs().max():.2e}")
        assert_fp32_close(logits, ref, forward_chain_terms(c, S, "logits"),
                          f"{name} at {layout}")
        assert same, f"{name} at {layout}: HF and checkpoint loads differ"
        if layout != "tp2pp2":
            split = 2 if layout == "ep2tp2" else 1
            assert experts == (c.num_moe_experts // 2, 2 * c.moe_ffn_hidden_size // split)


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_logits_match_transformers(models, worlds, world):
    for name, (hf_dir, ckpt) in models.items():
        ours, ref = worlds[world][0][name], _hf_logits(hf_dir)
        print(f"{name} tp {world}: max |logit - transformers| {(ours - ref).abs().max():.2e}")
        assert_fp32_close(ours, ref, forward_chain_terms(_config(ckpt), S, "logits"),
                          f"{name} at tp {world}")


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_greedy_generate_matches_transformers(models, worlds, world):
    """The engine's default cache for MLA: the compressed latents (test_mla_latent_cache.py
    compares it with full K/V)."""
    from transformers import AutoModelForCausalLM

    for name, (hf_dir, _) in models.items():
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        for prompt, ours in zip(PROMPTS, worlds[world][1][name], strict=True):
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                              pad_token_id=0)[0, len(prompt):].tolist()
            assert len(set(ref)) > 3, (name, ref)  # not one repeated id
            assert ours == ref, f"{name} at tp {world}: greedy ids differ from transformers'"


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_training_with_dropout_matches_one_process_at_every_layout(worlds, world):
    (ref_losses, ref_norms), = worlds[1][2][:1]
    assert ref_losses[-1] < ref_losses[0], ref_losses  # it learns
    runs = worlds[world][2][1:] if world == 1 else worlds[world][2]
    for flags, (losses, norms) in zip(LAYOUTS[world][1:] if world == 1 else LAYOUTS[world],
                                      runs, strict=True):
        k_step = training_chain_terms(DEEPSEEK + flags)
        assert len(losses) == 4, (flags, losses)
        assert_losses_close(losses, ref_losses, k_step, f"losses at {flags}")
        assert_losses_close(norms, ref_norms, k_step, f"grad norms at {flags}")


def test_dropout_is_on(corpus_env, tmp_path):
    """Without dropout the reference's losses differ (so the layouts above compare masks)."""
    off = DEEPSEEK + ["--hidden-dropout", "0", "--attention-dropout", "0"]
    (on_losses, _), (off_losses, _), _ = run_distributed(
        _train, 1, [DEEPSEEK, off], str(tmp_path), corpus_env["SHARDZOO_CACHE"],
        timeout=600)[0]
    assert on_losses != off_losses


def _tensors(folder: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def test_round_trip_is_bitwise_and_transformers_loads_it(models, tmp_path):
    from checkpoint.hf import export_hf
    from transformers import AutoModelForCausalLM

    for name, (hf_dir, ckpt) in models.items():
        c = _config(ckpt)
        assert c.multi_latent_attention and c.extra == {"hf_rope_interleave": name == "yarn"}
        assert (c.moe_router_num_groups, c.moe_layer_freq) == \
            ((2, [0, 1, 1]) if name == "yarn" else (None, 1))
        out = str(tmp_path / name)
        export_hf(ckpt, out, log=lambda *a: None)
        original, back = _tensors(hf_dir), _tensors(out)
        assert set(back) == set(original), sorted(set(back) ^ set(original))[:5]
        for key, t in back.items():
            assert torch.equal(t, original[key]), f"{name}: {key} differs after the round trip"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
        cfg_in = json.load(open(os.path.join(hf_dir, "config.json")))
        cfg_out = json.load(open(os.path.join(out, "config.json")))
        for key in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                    "v_head_dim", "rope_interleave", "n_group", "topk_group",
                    "first_k_dense_replace", "routed_scaling_factor", "n_shared_experts",
                    "n_routed_experts", "tie_word_embeddings", "rope_parameters"):
            assert cfg_out[key] == cfg_in[key], (name, key, cfg_out[key], cfg_in[key])


def test_yarn_and_group_routing_equal_transformers(no_grid):
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from layers.attention import rope_inv_freq
    from layers.moe.router import TopKRouter
    from layers.yarn import yarn_attention_factor
    from models import ModelConfig

    for beta_fast, orig, mscale in ((32, 16, (1.0, 0.8)), (8, 4096, (None, None)),
                                    (32, 4096, (0.7, 1.0))):
        params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                  "original_max_position_embeddings": orig, "beta_fast": beta_fast,
                  "beta_slow": 1, "mscale": mscale[0], "mscale_all_dim": mscale[1]}
        cfg = DeepseekV3Config(qk_rope_head_dim=64, rope_parameters=params)
        ref, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
        ours = rope_inv_freq(64, 10000.0, "yarn", 40.0, original_max_position=orig,
                             beta_fast=beta_fast, beta_slow=1)
        torch.testing.assert_close(ours.float(), ref, rtol=1e-6, atol=0)
        assert yarn_attention_factor(40.0, *mscale) == pytest.approx(factor, rel=1e-12)
    hf = DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                          topk_group=2, routed_scaling_factor=2.5)
    ref = DeepseekV3TopkRouter(hf)
    c = ModelConfig(hidden_size=32, num_moe_experts=16, moe_router_topk=4, add_bias_linear=False,
                    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_router_topk_scaling_factor=2.5, moe_router_num_groups=4,
                    moe_router_group_topk=2)
    c.validate()
    ours = TopKRouter(c)
    with torch.no_grad():
        ref.weight.normal_()
        ref.e_score_correction_bias.normal_(0, 0.3)
        ours.weight.copy_(ref.weight)
        ours.expert_bias.copy_(ref.e_score_correction_bias)
        x = torch.randn(64, 32)
        _, ref_w, ref_i = ref(x)
        routing = ours(x)
    order, ref_order = routing.indices.sort(-1), ref_i.sort(-1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(routing.probs.gather(1, order.indices),
                               ref_w.gather(1, ref_order.indices))
    groups = (routing.indices // 4)  # every token's experts come from at most 2 groups
    assert all(len(set(row.tolist())) <= 2 for row in groups)


def test_unsupported_fields_and_bad_configs_are_refused(models, tmp_path):
    from checkpoint.hf import import_hf
    from models import ModelConfig
    from models.config import ConfigError
    from models.hf import HFConversionError, config_from_hf
    from safetensors.torch import save_file

    hf_dir, _ = models["yarn"]
    base = json.load(open(os.path.join(hf_dir, "config.json")))
    bad = {"attention_bias": (True, "attention_bias"),
           "norm_topk_prob": (False, "norm_topk_prob"),
           "rms_norm_eps": (1e-5, "rms_norm_eps"),
           "num_key_value_heads": (2, "num_key_value_heads"),
           "rope_parameters": ({**base["rope_parameters"], "attention_factor": 1.2},
                               "attention_factor"),
           "first_k_dense_replace": (7, "first_k_dense_replace")}
    for key, (value, words) in bad.items():
        with pytest.raises(HFConversionError, match=words):
            config_from_hf({**base, key: value})
    # a partial multi-token-prediction layer (eh_proj alone) is refused, not dropped
    folder = tmp_path / "mtp"
    shutil.copytree(hf_dir, folder)
    tensors = _tensors(str(folder))
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HFConversionError, match="has no tensor 'model.layers.3."):
        import_hf(str(folder), str(tmp_path / "out"), log=lambda *a: None)
    assert not os.path.exists(tmp_path / "out")
    mla = dict(num_attention_heads=4, hidden_size=64, position_embedding_type="rope",
               normalization="RMSNorm", activation="swiglu", add_bias_linear=False,
               kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    for change, words in ((dict(num_query_groups=2), "--num-query-groups"),
                          (dict(qk_rope_head_dim=7), "--qk-rope-head-dim"),
                          (dict(window_size=(7, 0)), "--window-size"),
                          (dict(add_bias_linear=True), "--add-bias-linear"),
                          (dict(position_embedding_type="learned_absolute"), "rope"),
                          (dict(kv_lora_rank=None), "--kv-lora-rank is not set")):
        with pytest.raises(ConfigError, match=words):
            ModelConfig(**{**mla, **change}).validate()
    with pytest.raises(ConfigError, match="--num-attention-heads 4 is not divisible"):
        ModelConfig(**mla).validate(3)
    with pytest.raises(ConfigError, match="--moe-router-group-topk"):
        ModelConfig(**mla, num_moe_experts=8, moe_router_score_function="sigmoid",
                    moe_router_num_groups=4).validate()


def test_planner_lists_the_mla_parameters(no_grid):
    """planner/parameters.py's parameter list is the model's, names and sizes (with a
    low-rank query and without), and ModelConfig.num_parameters counts them."""
    import dataclasses

    from models import GPTModel
    from planner.parameters import chunk_parameters
    from training.arguments import load_model_config

    base = load_model_config("tiny-deepseek")
    for q_lora_rank in (32, None):
        c = dataclasses.replace(base, q_lora_rank=q_lora_rank)
        model = GPTModel(c)
        plan = chunk_parameters(c, 1, list(range(c.num_layers)), True, True, False)
        assert [(p.name, p.count) for p in plan] == \
            [(n, p.numel()) for n, p in model.named_parameters()]
        assert c.num_parameters() == sum(p.numel() for p in model.parameters())


def test_planner_flops_equal_torch_flop_counter(no_grid, monkeypatch):
    """planner/flops.py's forward FLOPs of tiny-deepseek (MLA with and without a low-rank
    query, dense and MoE layers, the output layer) equal what torch's FlopCounterMode counts
    in one forward of 16 tokens (torch's GEMMs: the counter does not see oneDNN's)."""
    import dataclasses

    from torch.utils.flop_counter import FlopCounterMode

    from layers import gemm
    from models import GPTModel
    from planner.flops import forward_flops_per_token
    from training.arguments import load_model_config

    monkeypatch.setattr(gemm, "_ONEDNN", False)
    base, s = load_model_config("tiny-deepseek"), 16
    for q_lora_rank in (32, None):
        c = dataclasses.replace(base, q_lora_rank=q_lora_rank)
        model = GPTModel(c).eval()
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(torch.randint(0, VOCAB, (1, s)))
        assert counter.get_total_flops() == s * forward_flops_per_token(c, s), q_lora_rank


@pytest.mark.parametrize("name, published_total, published_active, hf_fields", [
    ("deepseek-v3-671b", 685, 37, dict(
        vocab_size=129280, num_attention_heads=128, n_routed_experts=256, n_group=8,
        topk_group=4, first_k_dense_replace=3, routed_scaling_factor=2.5)),
    ("kimi-k2", 1040, 32, dict(
        vocab_size=163840, num_attention_heads=64, n_routed_experts=384, n_group=1,
        topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.827)),
])
def test_named_deepseek_shapes_match_transformers_and_published(no_grid, name, published_total,
                                                               published_active, hf_fields):
    """The parameters of the named configs equal transformers' DeepseekV3ForCausalLM of the
    same config.json fields (built on the meta device, per layer kind), and the published
    totals within 1.5% (DeepSeek-V3: 685B with its multi-token-prediction layer, 37B active;
    Kimi K2: 1.04T / 32B of its technical report) and active counts within 3% (whether the
    input embedding counts as active is not said). transformers builds no MTP layer: its
    count is one MoE layer's + enorm, hnorm, final norm and eh_proj `[h, 2h]`."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from planner import moe
    from training.arguments import load_model_config

    m = load_model_config(name)
    m.validate(8)
    dense = hf_fields["first_k_dense_replace"]

    def count(layers):
        cfg = DeepseekV3Config(
            hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
            num_hidden_layers=layers, num_key_value_heads=hf_fields["num_attention_heads"],
            n_shared_experts=1, num_experts_per_tok=8, kv_lora_rank=512, q_lora_rank=1536,
            qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
            tie_word_embeddings=False, **hf_fields)
        with torch.device("meta"):
            return sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    one_moe = count(dense + 1)
    hf_total = one_moe + (m.num_layers - dense - 1) * (count(dense + 2) - one_moe)
    mtp = (m.mtp_num_layers or 0) * (count(dense + 2) - one_moe + 3 * 7168 + 2 * 7168**2)
    hf_total += mtp
    counts = moe.parameter_counts(m)
    assert counts["mtp"] == mtp
    print(f"{name}: {counts['total'] / 1e9:.1f}B parameters ({mtp / 1e9:.2f}B MTP), "
          f"{counts['active'] / 1e9:.2f}B active")
    assert counts["total"] == hf_total == m.num_parameters()
    assert abs(counts["total"] / 1e9 / published_total - 1) < 0.015
    assert abs(counts["active"] / 1e9 / published_active - 1) < 0.03
