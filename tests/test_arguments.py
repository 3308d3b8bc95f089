"""The resolved run config: precedence, aliases, every validation error, named model files."""
from __future__ import annotations

from pathlib import Path

import pytest

from models.config import ConfigError
from training.arguments import (
    Config, TrainConfig, available_models, build_parser, load_model_config, parse_config,
)
from data_pipeline.data_path import parse_data_path

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def cfg(*argv: str, world_size: int | None = None) -> Config:
    c = parse_config(list(argv))
    return c.validate(world_size) if world_size else c


def raises(flag: str, *argv: str, world_size: int = 1) -> str:
    """Assert that validating argv fails with a message that names `flag`."""
    with pytest.raises(ConfigError) as e:
        cfg(*argv, world_size=world_size)
    assert flag in str(e.value), str(e.value)
    return str(e.value)


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------------------- sources
def test_precedence_model_file_then_run_file_then_flags(tmp_path):
    run = write(tmp_path, "model: tiny-gpt\nnum_layers: 4\nhidden-size: 128\nlr: 1e-3\n")
    c = cfg("--config", run, "--hidden-size", "96", "--num-attention-heads", "8")
    assert c.model.name == "tiny-gpt"
    assert c.model.seq_length == 64  # model file
    assert c.model.num_layers == 4  # run file over model file
    assert c.model.hidden_size == 96 and c.model.num_attention_heads == 8  # flags over both
    assert c.train.lr == 1e-3  # "1e-3" is a string to YAML 1.1; still read as a float
    assert c.model.ffn_hidden_size == 4 * 96  # not fixed by the model file: derived from h


def test_model_flag_overrides_run_file_model(tmp_path):
    run = write(tmp_path, "model: tiny-gpt\nnum_layers: 4\n")
    c = cfg("--config", run, "--model", "tiny-llama")
    assert c.model.name == "tiny-llama" and c.model.normalization == "RMSNorm"
    assert c.model.num_layers == 4  # run-file keys still win over the model file


def test_aliases_and_megatron_spellings():
    c = cfg("--model", "tiny-llama", "--tp", "2", "--pp", "2", "--vpp", "2",
            "--global-batch-size", "8", world_size=8)
    t = c.train
    assert (t.tensor_model_parallel_size, t.pipeline_model_parallel_size) == (2, 2)
    assert t.virtual_pipeline_model_parallel_size == 2
    assert t.num_layers_per_virtual_pipeline_stage == 1  # 4 layers / (pp 2 x vpp 2)
    assert c.data_parallel_size == 2 and c.num_microbatches == 4
    c = cfg("--model", "tiny-llama", "--pp", "2", "--num-layers-per-virtual-pipeline-stage",
            "1", "--global-batch-size", "2", world_size=2)
    assert c.train.virtual_pipeline_model_parallel_size == 2
    assert not cfg("--no-add-bias-linear").model.add_bias_linear


def test_yaml_aliases_and_dashes(tmp_path):
    run = write(tmp_path, "tp: 2\nmicro-batch-size: 4\nddp_bucket_size: 4e7\n")
    t = cfg("--config", run).train
    assert (t.tensor_model_parallel_size, t.micro_batch_size) == (2, 4)
    assert t.ddp_bucket_size == 40_000_000


def test_boolean_flags_turn_yaml_true_off(tmp_path):
    run = write(tmp_path, "sequence_parallel: true\noverlap_grad_reduce: true\nbf16: true\n")
    t = cfg("--config", run, "--no-sequence-parallel", "--no-overlap-grad-reduce").train
    assert (t.sequence_parallel, t.overlap_grad_reduce, t.bf16) == (False, False, True)
    assert cfg("--model", "tiny-gpt", "--untie-embeddings-and-output-weights") \
        .model.untie_embeddings_and_output_weights


def test_defaults_resolved_by_validate():
    c = cfg("--micro-batch-size", "2", "--train-iters", "50", world_size=4)
    assert c.train.global_batch_size == 8 and c.num_microbatches == 1
    assert c.train.lr_decay_iters == 50
    assert isinstance(c.train.tensorboard, bool)
    assert c.train.ddp_bucket_size == 40_000_000 and c.train.split == "969,30,1"
    assert c.train.sequence_parallel is False
    assert cfg("--sequence-parallel", world_size=1).train.sequence_parallel is False  # tp 1


def test_data_path_forms():
    assert parse_data_path(["a"]) == [(1.0, "a")]
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == [(0.3, "a"), (0.7, "b")]
    assert cfg("--data-path", "0.3", "a", "0.7", "b").train.data_path == ["0.3", "a", "0.7", "b"]
    for bad in ("inf", "nan"):  # not finite: refused here, not as a NaN deep in the blend
        raises("--data-path", "--data-path", bad, "a", "0.5", "b")


# ---------------------------------------------------------------------------- unknowns
def test_unknown_flag_suggests_close_match():
    with pytest.raises(ConfigError, match="--hidden-size"):
        parse_config(["--hiden-size", "64"])


def test_unknown_yaml_key_suggests_close_match(tmp_path):
    with pytest.raises(ConfigError, match="--num-layers"):
        parse_config(["--config", write(tmp_path, "num_layer: 3\n")])


def test_unknown_model_name_and_model_key(tmp_path):
    with pytest.raises(ConfigError, match="tiny-gpt"):
        parse_config(["--model", "tiny-gtp"])
    bad = write(tmp_path, "hidden_sise: 8\n", "m.yaml")
    with pytest.raises(ConfigError, match="hidden_sise"):
        parse_config(["--model", bad])


def test_bad_value_names_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="--lr"):
        parse_config(["--lr", "fast"])
    with pytest.raises(ConfigError, match="--micro-batch-size"):
        parse_config(["--config", write(tmp_path, "micro_batch_size: 1.5\n")])


# ---------------------------------------------------------------------------- validation
def test_grid_errors():
    raises("--tensor-model-parallel-size", "--tp", "2", "--pp", "2", world_size=6)
    raises("--num-attention-heads", "--model", "tiny-gpt", "--tp", "8", world_size=8)
    raises("--tensor-model-parallel-size", "--tp", "0")
    with pytest.raises(ConfigError, match="world size"):
        parse_config([]).validate(0)


def test_global_batch_error_names_numbers_and_suggests():
    msg = raises("--global-batch-size", "--micro-batch-size", "4", "--global-batch-size",
                 "30", world_size=2)
    assert "--micro-batch-size 4" in msg and "8" in msg and "--global-batch-size 32" in msg
    raises("--global-batch-size", "--global-batch-size", "0")


def test_sequence_parallel_needs_divisible_seq_length():
    raises("--sequence-parallel", "--model", "tiny-gpt", "--tp", "2", "--sequence-parallel",
           "--seq-length", "63", "--max-position-embeddings", "64", world_size=2)


def test_pipeline_split_errors():
    raises("--num-layers", "--model", "tiny-llama", "--num-layers", "5", "--pp", "2",
           world_size=2)
    msg = raises("--decoder-first-pipeline-num-layers", "--model", "tiny-llama",
                 "--num-layers", "8", "--pp", "3", "--decoder-first-pipeline-num-layers", "1",
                 world_size=3)
    assert "remaining --num-layers 7" in msg
    raises("--pipeline-model-parallel-size", "--decoder-last-pipeline-num-layers", "1")
    c = cfg("--model", "tiny-llama", "--num-layers", "8", "--pp", "4",
            "--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers",
            "1", world_size=4)
    assert c.stage_num_layers() == [1, 3, 3, 1]
    assert cfg("--model", "tiny-llama", "--pp", "2", world_size=2).stage_num_layers() == [2, 2]


def test_virtual_pipeline_errors():
    raises("--pipeline-model-parallel-size", "--vpp", "2")
    raises("--pipeline-model-parallel-size", "--num-layers-per-virtual-pipeline-stage", "1")
    raises("--virtual-pipeline-model-parallel-size", "--model", "tiny-llama", "--pp", "2",
           "--vpp", "3", "--global-batch-size", "2", world_size=2)
    raises("--num-layers-per-virtual-pipeline-stage", "--model", "tiny-llama", "--pp", "2",
           "--num-layers-per-virtual-pipeline-stage", "3", world_size=2)
    raises("--num-layers-per-virtual-pipeline-stage", "--model", "tiny-llama", "--pp", "2",
           "--vpp", "1", "--num-layers-per-virtual-pipeline-stage", "1", world_size=2)
    # interleaving needs num_microbatches % pp == 0 (here 3 microbatches, pp 2)
    msg = raises("--pipeline-model-parallel-size", "--model", "tiny-llama", "--pp", "2",
                 "--vpp", "2", "--global-batch-size", "3", world_size=2)
    assert "--global-batch-size 4" in msg
    # plain 1F1B may have fewer microbatches than stages (Megatron)
    assert cfg("--model", "tiny-llama", "--pp", "4", world_size=4).num_microbatches == 1


def test_optimizer_errors():
    raises("--min-lr", "--lr", "1e-4", "--min-lr", "1e-3")
    raises("--lr", "--lr", "-1")
    raises("--lr-warmup-iters", "--train-iters", "10", "--lr-warmup-iters", "20")
    raises("--lr-warmup-iters", "--lr-decay-iters", "5", "--lr-warmup-iters", "6")
    raises("--lr-decay-style", "--lr-decay-style", "step")
    raises("--train-iters", "--train-iters", "0")
    raises("--micro-batch-size", "--micro-batch-size", "0")
    raises("--adam-beta2", "--adam-beta2", "1.0")
    raises("--adam-eps", "--adam-eps", "0")
    raises("--clip-grad", "--clip-grad", "-1")
    raises("--weight-decay", "--weight-decay", "-0.1")
    raises("--peak-tflops", "--peak-tflops", "0")
    raises("--recompute-granularity", "--recompute-granularity", "some")
    raises("--compile", "--compile", "--recompute-granularity", "selective")
    assert cfg("--compile", "--recompute-granularity", "full", world_size=1).train.compile
    assert cfg("--clip-grad", "0", world_size=1).train.clip_grad == 0


def test_data_errors(tmp_path):
    raises("--data-path", "--data-path", "0.5", "a", "b")
    raises("--data-path", "--data-path", "x", "a", "0.5", "b")
    prefix = str(tmp_path / "corpus_text")
    msg = raises("--data-path", "--data-path", prefix)
    assert "corpus_text.bin" in msg and "tools/preprocess_data.py" in msg
    Path(prefix + ".bin").write_bytes(b"")
    msg = raises("--data-path", "--data-path", "1", prefix)
    assert "corpus_text.idx" in msg
    Path(prefix + ".idx").write_bytes(b"")
    msg = raises("--tokenizer-model", "--data-path", "1", prefix)
    assert "--data-path needs --tokenizer-model" in msg
    (tmp_path / "tok.model").write_bytes(b"")
    tok = str(tmp_path / "tok.model")
    assert cfg("--data-path", "1", prefix, "--tokenizer-model", tok,
               world_size=1).train.data_path == ["1", prefix]
    raises("--split", "--split", "90,x")
    raises("--tokenizer-model", "--tokenizer-model", str(tmp_path / "nope.model"))


def test_run_errors():
    raises("--eval-interval", "--eval-interval", "-1")
    raises("--eval-iters", "--eval-iters", "-1")
    raises("--log-interval", "--log-interval", "0")
    raises("--device", "--device", "tpu")
    assert cfg("--eval-interval", "0", world_size=1).train.eval_interval == 0


def test_model_errors_come_from_model_config():
    raises("--num-query-groups", "--model", "tiny-llama", "--num-query-groups", "3")
    raises("--position-embedding-type", "--position-embedding-type", "alibi")


# ---------------------------------------------------------------------------- output
def test_to_yaml_round_trip(tmp_path):
    c = cfg("--model", "tiny-llama", "--tp", "2", "--pp", "2", "--vpp", "2",
            "--global-batch-size", "16", "--micro-batch-size", "2", "--lr", "3e-3",
            "--no-overlap-grad-reduce", world_size=8)
    again = cfg("--config", write(tmp_path, c.to_yaml()), world_size=8)
    assert again == c
    assert "data_parallel_size 2" in c.to_yaml()
    custom = cfg("--hidden-size", "32", "--num-layers", "3", world_size=1)
    assert cfg("--config", write(tmp_path, custom.to_yaml()), world_size=1) == custom


def test_summary_is_short():
    s = cfg("--model", "gpt2-124m", world_size=1).summary()
    assert "124.4M" in s and len(s.splitlines()) <= 6


def test_help_lists_every_flag():
    text = build_parser().format_help()
    for flag in ("--tensor-model-parallel-size", "--tp", "--vpp", "--hidden-size",
                 "--no-tensorboard", "--data-path", "--peak-tflops", "--profile-pipeline"):
        assert flag in text


def test_help_says_each_default_once_and_never_none():
    """--optimizer-offload-fraction read "(default 1.0) (default: None)": a default the text
    already gives is not added again, and an unset (None) default is not shown."""
    import re

    text = " ".join(build_parser().format_help().split())
    assert "default: None" not in text
    assert "offloaded (default 1.0 with --optimizer-cpu-offload or " in text
    for entry in re.split(r" (?=--[a-z])", text):
        assert entry.count("default") <= 1 or "(default: " not in entry, entry
    assert "tokens per sample (default: 128)" in text  # given defaults still shown


# ---------------------------------------------------------------------------- named configs
NATURAL_TP = {
    "gpt2-124m": 1, "gpt2-350m": 2, "gpt2-774m": 4, "gpt2-1.5b": 5, "llama-style-135m": 3,
    "llama-style-1b": 2, "llama-7b": 4, "llama-8b": 8, "llama-70b": 8, "tiny-gpt": 2,
    "tiny-llama": 2, "small-gpt": 2, "small-llama": 2,
    "t5-small": 2, "t5-base": 2, "t5-large": 4, "t5-3b": 8, "t5-11b": 8, "t5-v1_1-small": 2,
    "t5-v1_1-base": 4, "t5-v1_1-large": 4, "t5-v1_1-xl": 8, "t5-v1_1-xxl": 8, "t5-tiny": 2,
    "tiny-moe": 2, "mixtral-8x7b": 8, "olmoe-1b-7b": 2, "qwen3-30b-a3b": 4, "tiny-deepseek": 2,
    "tiny-gpt-oss": 2, "gpt-oss-20b": 8, "gpt-oss-120b": 8, "deepseek-v3-671b": 8, "kimi-k2": 8,
}


def test_every_named_model_is_listed():
    assert sorted(NATURAL_TP) == available_models()


@pytest.mark.parametrize("name", sorted(NATURAL_TP))
def test_named_models_validate_at_natural_tp(name):
    tp = NATURAL_TP[name]
    sp = "--sequence-parallel" if tp in (2, 4, 8) else "--no-sequence-parallel"
    c = cfg("--model", name, "--tp", str(tp), sp, world_size=tp)
    assert c.model.name == name and c.train.sequence_parallel == (tp in (2, 4, 8))
    load_model_config(name).validate(1)


@pytest.mark.parametrize("name, expected", [
    ("gpt2-124m", 124.44e6), ("gpt2-350m", 354.8e6), ("gpt2-774m", 774.0e6),
    ("gpt2-1.5b", 1557.6e6), ("llama-style-135m", 134.5e6), ("llama-style-1b", 1235.8e6),
    ("llama-7b", 6738.4e6), ("llama-8b", 8030.3e6), ("llama-70b", 70553.7e6),
])
def test_parameter_counts(name, expected):
    # the published counts above are rounded to 0.1M at most: within half of that
    assert load_model_config(name).num_parameters() == pytest.approx(expected, abs=0.05e6)


@pytest.mark.parametrize("name, expected", [  # transformers' T5ForConditionalGeneration
    ("t5-small", 60_506_624), ("t5-base", 222_903_552), ("t5-large", 737_668_096),
    ("t5-3b", 2_851_598_336), ("t5-11b", 11_307_321_344), ("t5-v1_1-small", 76_961_152),
    ("t5-v1_1-base", 247_577_856), ("t5-v1_1-large", 783_150_080),
    ("t5-v1_1-xl", 2_849_757_184), ("t5-v1_1-xxl", 11_135_332_352),
])
def test_t5_parameter_counts_equal_hf(name, expected):
    assert load_model_config(name).num_parameters() == expected


def test_gpt2_124m_exact_parameter_count():
    assert load_model_config("gpt2-124m").num_parameters() == 124_439_808


def test_llama_70b_pipeline_layout():
    c = cfg("--model", "llama-70b", "--tp", "8", "--pp", "8", "--vpp", "5",
            "--global-batch-size", "64", world_size=128)
    assert c.data_parallel_size == 2 and c.num_microbatches == 32
    assert c.train.num_layers_per_virtual_pipeline_stage == 2


@pytest.mark.parametrize("run", ["demo", "tiny-gpt", "tiny-llama"])
def test_run_files_load_and_validate(run):
    c = cfg("--config", str(CONFIGS / f"{run}.yaml"), world_size=1)
    assert c.num_microbatches == c.train.global_batch_size // c.train.micro_batch_size
    assert c.train.train_iters >= 20


def test_train_config_defaults_are_megatron_like():
    t = TrainConfig()
    assert (t.seed, t.weight_decay, t.adam_beta2, t.clip_grad) == (1234, 0.01, 0.999, 1.0)
    assert t.log_dir == "runs/latest" and t.overlap_grad_reduce and t.device == "auto"


def test_compile_on_cpu_without_cpp_compiler_is_a_config_error(no_cpp_compiler):
    """Refused at validation, before any process starts (the layers' own check: test_layers)."""
    msg = raises("--compile", "--compile", "--device", "cpu")
    assert "C++ compiler" in msg and "drop --compile" in msg
    cfg("--device", "cpu", world_size=1)  # without --compile nothing needs a compiler


def test_folders_are_checked_not_created(tmp_path, monkeypatch):
    """Validation checks that --log-dir / --save could be written and creates nothing (the
    test suite used to leave empty runs/* folders in the checkout); a file in the way or an
    unwritable parent is refused by name."""
    log, save = tmp_path / "a" / "log", tmp_path / "b" / "ckpt"
    parse_config(["--log-dir", str(log), "--save", str(save)]).validate(1)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is under the file"):
        parse_config(["--log-dir", str(tmp_path / "file" / "log")]).validate(1)
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        parse_config(["--save", str(tmp_path / "file")]).validate(1)
    # the run files the tests use name folders relative to the current one: runs/latest,
    # runs/tiny-gpt, runs/tiny-llama were left empty in the checkout
    monkeypatch.chdir(tmp_path)
    for argv in ([], ["--config", str(CONFIGS / "tiny-gpt.yaml")],
                 ["--config", str(CONFIGS / "tiny-llama.yaml")]):
        parse_config(argv).validate(1)
    assert not (tmp_path / "runs").exists()


def test_unwritable_parent_is_refused(tmp_path, monkeypatch):
    import os

    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    # root (as CI runs) ignores permission bits: the access check itself answers as for a user
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if os.path.abspath(p) ==
                        str(locked) else real_access(p, mode))
    with pytest.raises(ConfigError, match="is not writable"):
        parse_config(["--log-dir", str(locked / "log")]).validate(1)


def test_finetune_defaults_fill_only_what_was_not_given(tmp_path):
    """`--load CKPT --finetune` alone gets a fine-tune's settings (not pretraining's global
    batch 1, no warm-up, min lr 0, validation every 1000 over 100 batches, runs/latest), the
    start-up lines say each one, and anything the run file or a flag gives wins."""
    base = tmp_path / "smol"
    base.mkdir()  # an empty folder: the model comes from --model here
    ft = ["--model", "tiny-llama", "--load", str(base), "--finetune"]
    c = cfg(*ft, "--train-iters", "20", "--save", str(tmp_path / "smol-ft"), world_size=1)
    t = c.train
    assert (t.global_batch_size, t.lr, t.lr_warmup_iters) == (16, 2e-5, 2)
    assert t.min_lr == pytest.approx(2e-6)
    assert (t.eval_interval, t.eval_iters, t.log_dir) == (5, 1, "runs/smol-ft")
    line = c.summary().splitlines()[-1]
    assert line.startswith("finetune defaults (not given): global batch 16, lr 2e-05, min lr "
                           "2e-06 (lr / 10), warm-up 2 iterations (3%, at least 2), validation "
                           "every 5 iterations, 1 batch each"), line
    assert "log dir runs/smol-ft (set with --global-batch-size, --lr, --min-lr" in line
    # proportionate to the run; the batch rounds up to whole steps (micro 3 x dp 2 = 6 -> 18)
    long = cfg(*ft, "--micro-batch-size", "3", world_size=2).train
    assert (long.train_iters, long.lr_warmup_iters, long.eval_interval, long.eval_iters,
            long.global_batch_size, long.log_dir) == (1000, 30, 250, 25, 18, "runs/smol-finetune")
    assert cfg(*ft, "--pp", "2", "--vpp", "2", "--num-layers", "4",
               world_size=4).num_microbatches % 2 == 0  # interleaving: a multiple of pp
    # given values win; min lr follows a given lr; a run file counts as given
    given = cfg(*ft, "--lr", "1e-4", "--global-batch-size", "4", "--eval-iters", "7",
                "--config", write(tmp_path, "log_dir: mine\nlr_warmup_iters: 0\n"), world_size=1)
    assert (given.train.lr, given.train.global_batch_size) == (1e-4, 4)
    assert given.train.min_lr == pytest.approx(1e-5)
    assert (given.train.eval_iters, given.train.lr_warmup_iters, given.train.log_dir) == \
        (7, 0, "mine")
    assert set(given.finetune_defaults) == {"min_lr", "eval_interval"}
    assert "global batch" not in given.summary() and "min lr 1e-05" in given.summary()
    # not a fine-tune: the pretraining defaults stay
    plain = cfg("--model", "tiny-llama", world_size=1)
    assert plain.train.global_batch_size == 1 and plain.finetune_defaults == {}
    assert "finetune" not in plain.summary()
