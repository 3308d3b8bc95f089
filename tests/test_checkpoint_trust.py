"""Checkpoints are untrusted input: on every load path (train.py --load,
infer.py --load, tools/convert_hf.py export, tools/checkpoint_info.py) a crafted `.metadata`
pickle is refused without running (a marker file it would create never appears), and a shard
swapped for another checkpoint's, a flipped byte, a truncated shard and a metadata.json whose
num_layers is not the checkpoint's are each refused naming the file, and so are a stored
tokenizer with a flipped byte (before it is parsed), a tokenizer folder metadata.json does not
list, and a link out of the folder. A metadata.json claiming 10^9 layers, nested 200,000
deep or larger than its cap is refused in one line, in bounded time and memory.

One tiny-llama run (saved at iterations 1 and 2) is trained once, in a spawned world of 1
process; each case damages its own copy of iteration 2. Every path is called in-process for
every case (train.main in one spawned world of 1, the others in this process); each CLI also
runs as its command line (the script as `__main__`) on the crafted pickle, and infer.py and
tools/checkpoint_info.py on the oversized metadata.json files, each case in a child forked
from one measured interpreter that imported torch once (launch.start_measured_cases).
"""
from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from launch import (finish_measured_cases, read_metrics, start_measured_cases,
                    train_in_one_world)

TRAIN = ["--config", "configs/tiny-llama.yaml", "--train-iters", "2", "--eval-interval", "0",
         "--log-interval", "1", "--peak-tflops", "1"]
CASES = ("pickle", "swapped", "flipped", "truncated", "num_layers", "tokenizer", "unlisted",
         "link")
SHARD = "__0_0.distcp"
# imported once by the measured process whose forked children run the command lines
PRELOAD = ["torch", "inference.loading", "training.trainer", "checkpoint.hf"]
# the file each case must be refused by, and a word of its problem
NAMED = {"pickle": (".metadata", "refused"), "swapped": (SHARD, "sha256"),
         "flipped": (SHARD, "sha256"), "truncated": (SHARD, "truncated"),
         "num_layers": ("metadata.json", "extra"), "tokenizer": ("tokenizer.model", "sha256"),
         "unlisted": ("tokenizer/added_tokens.json", "not listed"),
         "link": ("tokenizer.model", "outside the checkpoint folder")}


class _Payload:
    """Unpickling it creates the file `path` (what a crafted checkpoint could run instead)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _rehash(folder: Path, name: str) -> None:
    """Rewrite metadata.json's size and sha256 of `name` (an attacker edits both files)."""
    from checkpoint.format import describe_files

    meta = json.loads((folder / "metadata.json").read_text())
    entry = describe_files(str(folder), [name])[0]
    meta["files"] = [entry if f["name"] == name else f for f in meta["files"]]
    (folder / "metadata.json").write_text(json.dumps(meta, indent=1))


def _damage(case: str, folder: Path, save: Path, marker: Path) -> None:
    shard = folder / SHARD
    if case == "pickle":
        (folder / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
        _rehash(folder, ".metadata")
    elif case == "swapped":  # same name and size, another checkpoint's bytes
        other = save / "iter_0000001" / SHARD
        assert other.stat().st_size == shard.stat().st_size
        shutil.copyfile(other, shard)
    elif case == "flipped":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    elif case == "tokenizer":  # the stored SentencePiece model, parsed before any weight
        data = bytearray((folder / "tokenizer.model").read_bytes())
        data[len(data) // 2] ^= 0x01
        (folder / "tokenizer.model").write_bytes(bytes(data))
    elif case == "unlisted":  # an HF tokenizer folder (found before tokenizer.model) that
        # metadata.json does not list, with added tokens and a chat template
        from test_data import hf_tokenizer_dir

        hf_tokenizer_dir(folder / "tokenizer", ["a tokenizer nobody listed " * 20])
        (folder / "tokenizer" / "added_tokens.json").write_text('{"<unlisted>": 400}')
        (folder / "tokenizer" / "chat_template.jinja").write_text("{{ 'rendered' }}")
    elif case == "link":  # the same bytes, through a link out of the folder
        outside = folder.parent / "elsewhere.model"
        (folder / "tokenizer.model").rename(outside)
        (folder / "tokenizer.model").symlink_to(outside)
    elif case == "truncated":
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size // 2)
    else:  # num_layers: 2 of the checkpoint's 4 (the loader used to drop layers 2 and 3)
        meta = json.loads((folder / "metadata.json").read_text())
        assert meta["model"]["num_layers"] == 4
        meta["model"]["num_layers"] = 2
        (folder / "metadata.json").write_text(json.dumps(meta, indent=1))


@pytest.fixture(scope="module")
def hostile(tmp_path_factory, corpus_env):
    """(cases {name: damaged copy of iteration 2}, the marker path, the intact save folder)."""
    root = tmp_path_factory.mktemp("trust")
    save = root / "save"
    train_in_one_world(1, [TRAIN + ["--save", str(save), "--save-interval", "1", "--log-dir",
                                     str(root / "log")]], corpus_env["SHARDZOO_CACHE"])
    marker = root / "MARKER"
    cases = {}
    for case in CASES:
        cases[case] = root / case / "iter_0000002"
        shutil.copytree(save / "iter_0000002", cases[case])
        _damage(case, cases[case], save, marker)
    return cases, marker, save


def _missed(case: str, folder: Path, message: str, marker: Path) -> list[str]:
    """`[]` when `message` refuses `case` naming its file, and nothing ran; else why not."""
    name, word = NAMED[case]
    out = [] if str(folder / name) in message and word in message else \
        [f"{case}: not refused naming {name} ({word}): {message[-1500:]}"]
    if marker.exists():
        marker.unlink()  # so that the next case is judged on its own
        out.append(f"{case}: a crafted .metadata ran code")
    return out


def test_checkpoint_info_refuses(hostile, capsys):
    from tools import checkpoint_info

    cases, marker, _ = hostile
    missed = []
    for case, folder in cases.items():
        code = checkpoint_info.main([str(folder)])
        out = capsys.readouterr().out
        missed += _missed(case, folder, out, marker) + (
            [] if code == 1 and "status: BAD" in out else [f"{case}: exit {code}"])
    assert not missed, "\n".join(missed)


def test_export_refuses(hostile, tmp_path, capsys):
    from tools import convert_hf

    cases, marker, _ = hostile
    missed = []
    for case, folder in cases.items():
        for command in ("export", "export-gguf"):  # an HF folder, a GGUF file
            out = tmp_path / f"{case}-{command}"
            try:
                code = convert_hf.main([command, "--load", str(folder), "--out", str(out)])
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - a traceback: a miss
                code = repr(e)
            err = capsys.readouterr().err
            missed += _missed(case, folder, err, marker) + (
                [] if code == 1 and not out.exists() else [f"{case} {command}: exit {code}"])
    assert not missed, "\n".join(missed)


def test_infer_load_refuses(hostile, no_grid):
    from checkpoint.format import CheckpointError
    from inference.loading import load

    cases, marker, _ = hostile
    missed = []
    for case, folder in cases.items():
        try:
            load(load=str(folder))
            error = None
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - a traceback: a miss
            error = e
        missed += _missed(case, folder, str(error), marker) + (
            [] if isinstance(error, CheckpointError) else [f"{case}: {error!r}"])
    assert not missed, "\n".join(missed)


def test_train_load_refuses(hostile, tmp_path, corpus_env):
    """`train.py --load CKPT` (the model from the checkpoint): exit 1 naming the file, before
    any step."""
    from distributed import run_distributed
    from launch import train_main_worker

    cases, marker, _ = hostile
    argvs = [["--load", str(folder), "--train-iters", "3", "--eval-interval", "0",
              "--peak-tflops", "1", "--log-dir", str(tmp_path / case)]
             for case, folder in cases.items()]
    results = run_distributed(train_main_worker, 1, argvs, corpus_env["SHARDZOO_CACHE"],
                              timeout=300)[0]
    missed = []
    for (case, folder), (code, err, _) in zip(cases.items(), results):
        missed += _missed(case, folder, err, marker) + (
            [] if code == 1 and "train.py: checkpoint error:" in err else [f"{case}: exit {code}"])
        log = tmp_path / case / "metrics.jsonl"
        if log.exists() and [r for r in read_metrics(log.parent) if "loss" in r]:
            missed.append(f"{case}: trained")
    assert not missed, "\n".join(missed)


def test_every_cli_refuses_a_crafted_metadata_pickle(hostile, tmp_path, corpus_env):
    """The four command lines on the crafted `.metadata` (metadata.json rewritten to match
    its size and sha256, so only the restricted unpickler stands in the way)."""
    cases, marker, _ = hostile
    folder = cases["pickle"]
    commands = {
        "train": ["train.py", "--load", str(folder), "--train-iters", "3", "--eval-interval",
                  "0", "--peak-tflops", "1", "--log-dir", str(tmp_path / "log")],
        "infer": ["infer.py", "--load", str(folder), "--prompt", "hi", "--max-new-tokens", "1"],
        "export": ["tools/convert_hf.py", "export", "--load", str(folder), "--out",
                   str(tmp_path / "hf")],
        "info": ["tools/checkpoint_info.py", str(folder)],
    }
    proc = start_measured_cases(commands.values(), PRELOAD, 240, corpus_env)
    missed = []
    for k, (code, out, _) in zip(commands, finish_measured_cases(proc)):
        missed += [f"{k}: {m}" for m in _missed("pickle", folder, out, marker)] + (
            [] if code in (1, 2) and "Traceback" not in out else
            [f"{k}: exit {code}, or a traceback"])
    assert not missed, "\n".join(missed)


def test_pickle_with_stale_hash_is_not_unpickled(hostile, tmp_path):
    """metadata.json left as it was: `.metadata`'s sha256 differs, so it is never unpickled
    (the restricted unpickler is not even reached)."""
    from checkpoint.format import CheckpointError
    from checkpoint.safe_dcp import read_dcp_metadata

    cases, marker, save = hostile
    folder = tmp_path / "iter_0000002"
    shutil.copytree(save / "iter_0000002", folder)
    payload = pickle.dumps(_Payload(str(marker)))
    (folder / ".metadata").write_bytes(payload)
    meta = json.loads((folder / "metadata.json").read_text())
    for f in meta["files"]:
        if f["name"] == ".metadata":
            f["bytes"] = len(payload)  # same size: only the sha256 tells
    with pytest.raises(CheckpointError, match="sha256 differs"):
        read_dcp_metadata(str(folder), meta)
    assert not marker.exists()


def test_pickled_object_entries_are_refused(tmp_path):
    """A checkpoint DCP itself wrote with a non-tensor entry: DCP would
    `torch.load(weights_only=False)` it on load; ours refuses it by name, in `.metadata`'s
    check and again in the planner."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from checkpoint.format import CheckpointError, describe_files
    from checkpoint.safe_dcp import single_process
    from checkpoint.safe_dcp import LoadPlanner, read_dcp_metadata

    marker = tmp_path / "MARKER"
    folder = tmp_path / "ckpt"
    with single_process():
        dcp.save({"x": torch.ones(3), "obj": _Payload(str(marker))},
                 storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    meta = {"files": describe_files(str(folder), os.listdir(folder))}
    with pytest.raises(CheckpointError, match="'obj' is a pickled object"):
        read_dcp_metadata(str(folder), meta)  # .metadata unpickles (DCP's classes only)

    item = ReadItem(LoadItemType.BYTE_IO, MetadataIndex("obj"), torch.Size([0]),
                    MetadataIndex("obj"), torch.Size([0]), torch.Size([0]))
    with pytest.raises(CheckpointError, match="'obj' is a pickled object"):
        LoadPlanner().load_bytes(item, io.BytesIO(b""))
    assert not marker.exists()


def test_config_larger_than_the_files_is_refused_with_the_numbers(hostile, tmp_path):
    """A metadata.json claiming a far larger model (hidden 8192, 80 layers) is refused before
    anything is built from it: the bytes it needs and the bytes the shards hold."""
    from checkpoint.format import CheckpointError, read_metadata

    _, _, save = hostile
    folder = tmp_path / "iter_0000002"
    shutil.copytree(save / "iter_0000002", folder)
    meta = json.loads((folder / "metadata.json").read_text())
    meta["model"].update(num_layers=80, hidden_size=8192, ffn_hidden_size=28672,
                         num_attention_heads=64, num_query_groups=8, kv_channels=128)
    (folder / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError) as e:
        read_metadata(str(folder))
    msg = str(e.value)
    assert str(folder / "metadata.json") in msg and "bytes in float32" in msg, msg
    held = (folder / SHARD).stat().st_size
    assert f"hold {held:,} bytes" in msg, msg


class _Reduce:
    """Pickles as `fn(*args)`."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def test_unpickler_builds_dcp_metadata_only(hostile, tmp_path):
    """The restricted unpickler reads a real `.metadata`, and refuses other globals (without
    calling them) and a path that would join one memoized string into a huge allocation."""
    import pathlib

    from checkpoint.safe_dcp import _Unpickler

    _, marker, save = hostile
    with open(save / "iter_0000002" / ".metadata", "rb") as f:
        md = _Unpickler(f).load()
    assert "model.embedding.word_embeddings.weight" in md.state_dict_metadata
    for payload, refused in [
            (_Reduce(os.system, f"touch {marker}"), "posix.system"),
            (_Reduce(eval, f"open({str(marker)!r}, 'w')"), "builtins.eval"),
            (_Reduce(shutil.rmtree, str(tmp_path)), "shutil.rmtree"),
            (_Reduce(pathlib.PosixPath, *["x" * 1000] * 100), "not a short string")]:
        with pytest.raises(pickle.UnpicklingError, match=refused):
            _Unpickler(io.BytesIO(pickle.dumps(payload))).load()
    assert not marker.exists() and tmp_path.exists()


def test_unpickler_refuses_build_on_a_class(hostile):
    """BUILD with a class on the stack sets the class's own attributes for the whole process
    (a found attack: `Metadata.__getstate__` replaced, so the next save crashed): refused, and
    DCP's class is untouched."""
    from torch.distributed.checkpoint.metadata import Metadata

    from checkpoint.safe_dcp import _Unpickler

    _, _, save = hostile
    raw = (save / "iter_0000002" / ".metadata").read_bytes()
    poison = (b"ctorch.distributed.checkpoint.metadata\nMetadata\n" + b"N}"
              + b"\x8c\x0c__getstate__" + b"ctorch.serialization\n_get_layout\n" + b"s\x86b0")
    with pytest.raises(pickle.UnpicklingError, match="sets attributes of a class"):
        _Unpickler(io.BytesIO(raw[:2] + poison + raw[2:])).load()
    assert "__getstate__" not in vars(Metadata)


def test_overlapping_chunks_that_leave_a_gap_are_refused(hostile, tmp_path):
    """Two chunks of a 64-element tensor at offsets 0 (33 elements) and 32 (31 elements) add
    up to 64 but leave element 63 unread (a found attack: the load kept the old value)."""
    import dataclasses

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    from checkpoint.safe_dcp import _Unpickler, _validate

    _, _, save = hostile
    with open(save / "iter_0000002" / ".metadata", "rb") as f:
        md = _Unpickler(f).load()
    fqn = "model.decoder.layers.0.input_layernorm.weight"
    tmd = md.state_dict_metadata[fqn]
    (chunk,) = tmd.chunks
    info = md.storage_data.pop(MetadataIndex(fqn, chunk.offsets))
    shard_end = max(i.offset + i.length for i in md.storage_data.values()) + 4096
    tmd.chunks = [ChunkStorageMetadata(torch.Size([0]), torch.Size([33])),
                  ChunkStorageMetadata(torch.Size([32]), torch.Size([31]))]
    md.storage_data[MetadataIndex(fqn, torch.Size([0]))] = dataclasses.replace(
        info, offset=shard_end, length=4096)
    md.storage_data[MetadataIndex(fqn, torch.Size([32]))] = dataclasses.replace(
        info, offset=shard_end + 4096, length=4096)
    listed = {SHARD: shard_end + 8192}
    problem = _validate(md, listed)
    assert problem and "overlapping chunks at (0,) and (32,)" in problem, problem


@pytest.mark.parametrize("field,value", [("num_layers", 2.0), ("num_layers", True),
                                         ("hidden_size", "64"), ("layernorm_epsilon", "x")])
def test_model_field_of_the_wrong_type_is_refused(hostile, tmp_path, field, value):
    """A metadata.json value of the wrong JSON type is refused by name (it used to surface as
    a TypeError from the model's constructor; `true` passed as 1)."""
    from checkpoint.format import CheckpointError, read_metadata

    _, _, save = hostile
    folder = tmp_path / "iter_0000002"
    shutil.copytree(save / "iter_0000002", folder)
    meta = json.loads((folder / "metadata.json").read_text())
    meta["model"][field] = value
    (folder / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=f"{field} is {value!r}"):
        read_metadata(str(folder))


def _metadata_case(case: str, folder: Path) -> None:
    meta_path = folder / "metadata.json"
    meta = json.loads(meta_path.read_text())
    if case == "layers":  # each size used to be looped over before any check
        meta["model"]["num_layers"] = 10**9
    elif case == "moe_layers":
        meta["model"].update(num_layers=10**9, num_moe_experts=4, moe_ffn_hidden_size=64,
                             moe_layer_freq=2)
    elif case == "large":  # past the cap: refused by its size, never parsed
        meta["padding"] = " " * (16 * 2**20)
    text = json.dumps(meta)
    if case == "nested":
        text = "[" * 200_000 + text + "]" * 200_000
    meta_path.write_text(text)


def test_metadata_sizes_and_nesting_are_bounded(hostile, tmp_path):
    """tools/checkpoint_info.py and infer.py --load on a metadata.json whose model claims 10^9
    (dense or MoE) layers, one nested 200,000 deep and one past the size cap: each exits with
    one line naming metadata.json within the timeout (10^9 layers used to hang in
    `ModelConfig.num_parameters`, the nesting raised RecursionError), under 400 MiB."""
    _, _, save = hostile
    expect = {"layers": "1000000000 layers", "moe_layers": "1000000000 layers",
              "nested": "RecursionError", "large": "more than the 16,777,216 accepted"}
    argvs = {}
    for case in expect:
        folder = tmp_path / case / "iter_0000002"
        shutil.copytree(save / "iter_0000002", folder)
        _metadata_case(case, folder)
        argvs[case, "info"] = ["tools/checkpoint_info.py", folder]
        argvs[case, "infer"] = ["infer.py", "--load", folder, "--prompt", "hi",
                                "--max-new-tokens", "1"]
    proc = start_measured_cases(argvs.values(), PRELOAD)
    missed = []
    for (case, tool), (code, out, peak) in zip(argvs, finish_measured_cases(proc)):
        line = next((x for x in out.splitlines() if "metadata.json" in x), "")
        if code not in (1, 2) or "Traceback" in out or expect[case] not in line or \
                str(tmp_path / case / "iter_0000002" / "metadata.json") not in line:
            missed.append(f"{case} {tool}: exit {code}: {out[-1500:]}")
        if peak >= 400:
            missed.append(f"{case} {tool}: peak {peak:.0f} MiB")
    assert not missed, "\n".join(missed)
