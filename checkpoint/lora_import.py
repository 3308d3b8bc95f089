"""peft's adapter files in: `import_adapter` writes a PEFT LoRA adapter folder as a LoRA run's
checkpoint (training/lora_checkpoint.py), the reverse of checkpoint/lora_files.py
`export_adapter`.

The adapter is read by models/hf/peft_adapter.py `read_peft_tensors` (every file untrusted:
safetensors only, each tensor's name, dtype and shape checked against the base before its
data is read, finite values, plain LoRA only). Each HF module's `lora_A.weight` `[r, in]` and
`lora_B.weight` `[out, r]` become our `<linear>.lora.A.<part>` / `.lora.B.<part>` as they are
(float32; peft's scale `lora_alpha / r` or `/ sqrt(r)` is ours too), so export-adapter then
import-adapter gives the same tensors bit for bit. metadata.json records the adapter settings
(`lora`: rank, alpha, dropout, target modules, rsLoRA, base quantization) and the base's
identity as a LoRA run does (path + sha256 of a checkpoint, or of a GGUF file), with no
optimizer state: `train.py --lora-rank R ... --load OUT` loads the base from its recorded
path, checks its digest, and continues fine-tuning from the imported adapters at any layout
(iteration 0, fresh AdamW moments).
"""
from __future__ import annotations

import os
import sys

from layers.lora import ALL_PARTS
from models.hf.peft_adapter import AdapterError, lora_targets, read_peft_tensors

from .format import CheckpointError, read_metadata, require_checkpoint
from .keys import expected_tensors
from .lora_files import _lora_model, adapter_tensors, base_digest, file_digest, is_gguf
from .model_io import ZERO_COUNTERS, add_lazy_tensor, write_checkpoint_folder


def _base(base: str, quantization: str | None) -> tuple[object, dict, str]:
    """`(model config, identity, base quantization)` of the base `base` names: a native
    checkpoint (folder, --save folder or iter_XXXXXXX) or a GGUF file."""
    if is_gguf(base):
        from models.hf import open_checked

        if quantization not in (None, "gguf"):
            raise CheckpointError(f"--base {base} is a GGUF file, whose blocks a LoRA run keeps "
                                  f"as stored (--lora-base-quantization gguf), not "
                                  f"{quantization}; drop --lora-base-quantization")
        _, config = open_checked(base, quantization="keep")
        return config, {"path": os.path.abspath(base), "sha256": file_digest(base),
                        "format": "gguf"}, "gguf"
    if quantization == "gguf":
        raise CheckpointError(f"--lora-base-quantization gguf keeps a GGUF file's blocks, but "
                              f"--base {base} is not a .gguf file; pass one, or another format")
    from models.config import ModelConfig

    path = require_checkpoint(base)
    meta = read_metadata(path)
    if meta.get("lora"):
        raise CheckpointError(f"--base {path} is a LoRA run's checkpoint (adapters only); pass "
                              f"the base checkpoint its adapters were trained on "
                              f"({(meta['lora'].get('base') or {}).get('path')})")
    config = ModelConfig.from_dict(meta["model"])
    return config, {"path": os.path.abspath(path), "sha256": base_digest(meta)}, \
        quantization or "none"


def import_adapter(adapter: str, base: str, out: str, base_quantization: str | None = None,
                   log=print) -> str:
    """Write LoRA checkpoint folder `out` holding the PEFT adapter in folder `adapter` for the
    base `base` (a native checkpoint, or a GGUF file for QLoRA on its blocks); returns `out`.
    `base_quantization`: the format a run holds the base in (`--lora-base-quantization`;
    default none, gguf for a GGUF base), recorded as a LoRA run records it. Raises
    `AdapterError` (a refused adapter file, see `read_peft_tensors`; an adapter for another
    base; a module peft adapts in some layers only, or one our LoRA has no part for) or
    `CheckpointError` (`out` exists, a base that is a LoRA checkpoint), before `out` exists.
    """
    if os.path.exists(out):
        raise CheckpointError(f"--out {out} already exists; pass a new folder (nothing was "
                              f"written)")
    config, identity, quantization = _base(base, base_quantization)
    settings, found = read_peft_tensors(adapter, config, max_rank=sys.maxsize)
    where = os.path.join(adapter, "adapter_model.safetensors")
    present = {m.rsplit(".", 1)[-1] for m in found}
    fused = sorted(present - set(ALL_PARTS))
    if fused:
        raise AdapterError(f"{where}: adapters on {', '.join(fused)} (fused HF modules) have "
                           f"no LoRA of ours, which adapts {', '.join(ALL_PARTS)} one by one; "
                           f"train the adapter on a base with separate projections")
    targets = lora_targets(config)
    every = {m.rsplit(".", 1)[-1] for t in targets.values() for m in t.parts}
    lora = {"rank": settings.r, "alpha": settings.lora_alpha,
            "dropout": settings.lora_dropout,
            "target_modules": "all-linear" if present == every else
            ",".join(p for p in ALL_PARTS if p in present),
            "use_rslora": settings.use_rslora, "base_quantization": quantization,
            "base": identity}
    model = _lora_model(config, lora)
    sd, lazy = dict(ZERO_COUNTERS), {}
    for hf, name, p in adapter_tensors(model, config, "import it onto a base with separate "
                                                      "projections"):
        if hf not in found:
            raise AdapterError(
                f"{where}: has {hf.rsplit('.', 1)[-1]} adapters but none on {hf}; our LoRA "
                f"adapts a target module in every layer (peft's layers_to_transform is not "
                f"supported), so train the adapter on all {config.num_layers} layers")
        tensor = found[hf][0 if name.split(".")[-2] == "A" else 1]  # <...>.lora.A.<part>
        add_lazy_tensor(sd, lazy, name, p, tuple(p.shape), lambda t=tensor: t)
    flags = {"lora_rank": lora["rank"], "lora_alpha": lora["alpha"],
             "lora_dropout": lora["dropout"], "lora_target_modules": lora["target_modules"],
             "use_rslora": lora["use_rslora"], "lora_base_quantization": quantization}
    write_checkpoint_folder(
        out, config, sd, lazy, run_flags=flags, tensors=lambda _: expected_tensors([model]),
        source={"format": "peft", "path": os.path.abspath(adapter)},
        extra={"optimizer_state": False, "lora": lora})
    log(f"imported {len(found)} LoRA adapters (rank {settings.r}, {lora['target_modules']}) "
        f"of {adapter} onto the base {identity['path']} into {out}")
    return out
