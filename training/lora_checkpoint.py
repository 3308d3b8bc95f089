"""Checkpoints of a LoRA run (`--lora-rank`, layers/lora.py): the adapters, not the base.

A LoRA run's checkpoint holds its adapters (with their AdamW moments), the usual iteration,
data position and RNG, and in metadata.json `lora`: the adapter settings (`rank`, `alpha`,
`dropout`, `target_modules`, `use_rslora`, `base_quantization`: QLoRA's format of the frozen
base) and the base's identity `base`:

- `{"path": <absolute iter_XXXXXXX folder>, "sha256": <digest>}` for a base loaded from a
  checkpoint (`--load BASE`): the digest is sha256 over the base's metadata.json file list
  (each file's name, size and sha256, sorted by name), so it names the exact weight files, and
  loading checks every file against its listed sha256 before any tensor is read;
- `{"path": null, "seed": S}` for a base made from `--seed S` (no `--load`);
- `{"path": <absolute .gguf file>, "sha256": <the file's sha256>, "format": "gguf"}` for a
  base read from a GGUF file with its blocks kept (`--load model.gguf
  --lora-base-quantization gguf`, `load_gguf_base`).

`--load` of a LoRA run takes either a plain checkpoint (the base: its weights go into the
frozen parameters, the adapters start from their init, iteration 0) or a LoRA checkpoint (the
base is read again from its recorded path and must have the recorded digest, then the
adapters and optimizer resume, at any layout). A LoRA checkpoint loaded without `--lora-rank`,
with other adapter settings, or onto a base whose files changed is refused with a
`CheckpointError` naming the fix.
"""
from __future__ import annotations

import os

import torch.distributed as dist

from checkpoint.format import SHAPE_FIELDS, CheckpointError, compare_model, read_metadata
from checkpoint.lora_files import base_digest, file_digest, is_gguf
from checkpoint.model_io import load_model_weights
from layers.lora import resolve_targets

def lora_settings(t) -> dict:
    """The adapter settings of TrainConfig `t`, as metadata.json `lora` records them."""
    return {"rank": t.lora_rank, "alpha": t.lora_alpha, "dropout": t.lora_dropout,
            "target_modules": t.lora_target_modules, "use_rslora": t.use_rslora,
            "base_quantization": t.lora_base_quantization}


def _same_setting(key: str, saved, now) -> bool:
    """Whether a LoRA checkpoint's setting `saved` is this run's `now` (target modules
    compared as the parts they select: "q_proj,v_proj" is "v_proj,q_proj")."""
    if key == "target_modules":
        try:
            return resolve_targets(saved) == resolve_targets(now)
        except (ValueError, TypeError, AttributeError):
            return False
    return saved == now


def refuse_lora_checkpoint(meta: dict, path: str) -> None:
    """A run without --lora-rank must not resume a LoRA checkpoint (it holds no base)."""
    if meta.get("lora"):
        lora = meta["lora"]
        raise CheckpointError(
            f"{path} holds LoRA adapters only (rank {lora.get('rank')}, targets "
            f"{lora.get('target_modules')!r}, base {lora.get('base', {}).get('path')}); resume "
            f"it with its run's --lora-* flags (see its config.yaml), or export it with "
            f"tools/convert_hf.py export-adapter / merge")


def load_base(config, chunks, path: str, meta: dict) -> dict:
    """Load the frozen base of a LoRA run into `chunks` (collective) and return its identity
    (metadata.json `lora.base`). `path`/`meta`: the checkpoint `--load` names: the base itself
    (a plain checkpoint) or a LoRA checkpoint recording its base. Raises `CheckpointError` for
    other adapter settings, a missing base, or a base whose files are not the recorded ones."""
    t = config.train
    lora = meta.get("lora")
    if t.lora_base_quantization == "gguf" and not (lora or {}).get("base", {}).get("format"):
        raise CheckpointError(f"--lora-base-quantization gguf keeps the blocks of a GGUF "
                              f"file, but {path} is a checkpoint; pass --load model.gguf (or "
                              f"a LoRA checkpoint trained on one), or another "
                              f"--lora-base-quantization")
    if not lora:
        load_model_weights(path, chunks, part="base")
        return {"path": os.path.abspath(path), "sha256": base_digest(meta)}
    diffs = [f"{k}: checkpoint {lora.get(k)!r}, this run {v!r}"
             for k, v in lora_settings(t).items() if not _same_setting(k, lora.get(k), v)]
    if diffs:
        raise CheckpointError(f"{path}: its adapters differ from this run's --lora-* flags "
                              f"({'; '.join(diffs)}); pass the checkpoint's values (see its "
                              f"config.yaml)")
    base = lora.get("base") or {}
    if base.get("path") is None:
        if base.get("seed") != t.seed:
            raise CheckpointError(f"{path}: its adapters were trained on the base made from "
                                  f"--seed {base.get('seed')}, not this run's --seed {t.seed}; "
                                  f"pass --seed {base.get('seed')}")
        return base
    base_path = str(base["path"])
    if base.get("format") == "gguf":
        digest = file_digest(base_path) if os.path.isfile(base_path) else None
        if digest != base.get("sha256"):
            raise CheckpointError(
                f"{path}: its adapters were trained on the GGUF file {base_path} with sha256 "
                f"{base.get('sha256')}, but that file " + ("is gone" if digest is None else
                                                         f"now has sha256 {digest}") +
                "; restore it, or start a new LoRA run on another base")
        return load_gguf_base(config, chunks, base_path, digest)
    try:
        base_meta = read_metadata(base_path)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: the base checkpoint it was trained on cannot be read "
                              f"({e}); restore {base_path}") from None
    if base_digest(base_meta) != base.get("sha256"):
        raise CheckpointError(
            f"{path}: its adapters were trained on the base {base_path} with sha256 "
            f"{base.get('sha256')}, but that folder now holds other weights (sha256 "
            f"{base_digest(base_meta)}); adapters only fit the base they were trained on: "
            f"restore that base, or start a new LoRA run on this one")
    compare_model(base_meta, config.model.to_dict(), base_path)
    load_model_weights(base_path, chunks, part="base")
    if dist.get_rank() == 0:
        print(f"LoRA base: {base_path} (sha256 {base['sha256'][:12]}... as recorded)",
              flush=True)
    return base


def load_gguf_base(config, chunks, path: str, digest: str | None = None) -> dict:
    """QLoRA's frozen base as GGUF file `path` stores it: every tensor of a block format
    (q8_0, q4_0, q4_1, q4_k, q6_k; models/hf/gguf_tensors.py) installed as this rank's
    shard of a `QuantizedWeight` over the file's blocks, never de-quantized and
    re-quantized; F32 / F16 tensors (norms) into the float parameters; the adapters left
    as initialized (checkpoint/hf.py `load_hf_weights`, part "base"). Collective-free; every
    rank reads its shards. Returns the base's identity (`digest`: the file's sha256, computed
    when not given). Raises `CheckpointError` when the file's model is not this run's (shape
    fields), `HFConversionError` / ValueError naming a tensor the file or the layout cannot
    give (a tp that cuts a block)."""
    from checkpoint.hf import load_hf_weights
    from layers.quantized import Quantization
    from models.hf import open_checked

    src, model = open_checked(path, quantization="keep")
    ours, theirs = config.model.to_dict(), model.to_dict()
    diffs = [f"{k}: file {theirs[k]!r}, this run {ours[k]!r}" for k in SHAPE_FIELDS
             if k in theirs and k in ours and theirs[k] != ours[k]]
    if diffs:
        raise CheckpointError(f"{path}: the GGUF file's model does not match this run's "
                              f"({'; '.join(diffs)}); drop the flags that change the model "
                              f"(its fields come from the file)")
    load_hf_weights(src, config.model, chunks, quantization=Quantization(), part="base")
    if dist.get_rank() == 0:
        print(f"LoRA base: {path}, its blocks kept as stored (--lora-base-quantization gguf)",
              flush=True)
    return {"path": os.path.abspath(path), "sha256": digest or file_digest(path),
            "format": "gguf"}
