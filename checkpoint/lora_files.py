"""A LoRA run's checkpoint (layers/lora.py, training/lora_checkpoint.py) out to peft's files.

`export_adapter`: `adapter_config.json` + `adapter_model.safetensors` in peft's format
(`peft.PeftModel.from_pretrained(<transformers base>, folder)` loads them): each adapter of
ours is `base_model.model.<HF module>.lora_A.weight` `[r, in]` and `.lora_B.weight`
`[out, r]`, the HF module named by the model family's conversion rules (the PEFT names of
models/hf/peft_adapter.py, which reads such folders back for serving): our fused
QKV's adapters are `q_proj`, `k_proj`, `v_proj`, fc1's `gate_proj`, `up_proj`. peft scales by
`lora_alpha / r` (`alpha / sqrt(r)` with `use_rslora`), as we do.

`merge_adapter`: the base checkpoint the adapters were trained on (its recorded path and
digest checked) exported as a plain HF folder with `W + s B A` folded into each adapted weight.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil

import torch

from layers.lora import LoRA, add_lora, lora_scale
from models import hf as hfmap
from models.hf import HFConversionError
from models.hf.peft_adapter import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, PLAIN_LORA, AdapterError,
                                    lora_targets, peft_key)

from .format import CheckpointError, read_metadata, require_checkpoint
from .keys import _dense_model, expected_tensors, part_keys
from .model_io import open_checkpoint, read_dense_tensor


def base_digest(meta: dict) -> str:
    """sha256 over a checkpoint's metadata.json file list (name, bytes, sha256 of each): the
    identity of its weight files that a LoRA checkpoint records for its base."""
    import hashlib

    files = sorted((f["name"], f["bytes"], f["sha256"]) for f in meta["files"])
    return hashlib.sha256(json.dumps(files).encode()).hexdigest()


def is_gguf(path) -> bool:
    """Whether `path` names a GGUF file (a LoRA run's base read with its blocks kept)."""
    return bool(path) and str(path).endswith(".gguf") and os.path.isfile(path)


def file_digest(path: str) -> str:
    """sha256 of the file `path` (a GGUF base's identity), read in 16 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(16 * 2**20), b""):
            h.update(piece)
    return h.hexdigest()


def _lora_model(config, lora: dict):
    """`config`'s whole model (tp 1, meta device) with the adapters metadata.json `lora`
    describes."""
    model = _dense_model(config)
    with torch.device("meta"):
        add_lora(model, lora["rank"], lora["alpha"], 0.0, lora["target_modules"],
                 lora["use_rslora"])
    return model


def adapter_tensors(model, config, fix: str):
    """`(HF module, parameter name, parameter)` of each adapter tensor of LoRA `model` (a
    `_lora_model` of `config`), A then B of each part, the HF module in peft's names
    (`lora_targets`). Raises `HFConversionError` (ending with `fix`) for a part whose HF
    form has no module of its own (a fused qkv_proj, GPT-2's Conv1D)."""
    try:
        targets = lora_targets(config)  # HF modules of each of our linears, peft's names
    except AdapterError:  # a family without nn.Linear modules (GPT-2): said per module below
        targets = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, LoRA):
            continue
        host = prefix[: -len(".lora")]
        hf_parts = targets[host].parts if host in targets else ()
        for k, (part, _) in enumerate(module.parts):
            if part not in module.A:
                continue
            hf = hf_parts[k] if len(hf_parts) == len(module.parts) else ""
            if hf.rsplit(".", 1)[-1] != part:
                raise HFConversionError(
                    f"{host}: its HF form ({', '.join(hf_parts) or 'none'}) has no {part} "
                    f"module for a peft adapter; {fix}")
            for kind in ("A", "B"):
                yield hf, f"{prefix}.{kind}.{part}", getattr(module, kind)[part]


def read_adapters(load: str) -> tuple[object, dict, dict[str, torch.Tensor]]:
    """`(model config, metadata.json lora, {"<HF module>": (A [r, in], B [out, r])})` of the
    LoRA checkpoint `load` (a --save folder or iter_XXXXXXX, any layout), dense float32,
    verified first. `CheckpointError` for a checkpoint without adapters; `HFConversionError`
    when the model's HF form has no module per adapter (a fused qkv_proj, GPT-2's Conv1D)."""
    path = require_checkpoint(load)
    meta = read_metadata(path)
    lora = meta.get("lora")
    if not lora:
        raise CheckpointError(f"{path} is not a LoRA run's checkpoint (metadata.json has no "
                              f"lora); export a full model with `export`")
    from models.config import ModelConfig

    config = ModelConfig.from_dict(meta["model"])
    model = _lora_model(config, lora)
    expected = expected_tensors([model])
    meta, md = open_checkpoint(path, lambda _: expected)
    out = {}
    for hf, name, p in adapter_tensors(model, config, "export the merged model instead "
                                                      "(`merge`)"):
        out.setdefault(hf, []).append(read_dense_tensor(path, md, part_keys("model", name, p),
                                                        p))
    out = {hf: tuple(pair) for hf, pair in out.items()}
    return config, lora, out


def _moe_blocks(config) -> list[str]:
    """The HF module names of `config`'s MoE blocks (the parent of each MoE layer's router,
    e.g. `model.layers.1.mlp`), whose routers, experts and shared experts hold no adapters
    (layers/lora.py); [] for a dense model."""
    rules = {r.native: r for r in hfmap.rules_for(config)}
    out = []
    for n in range(config.num_layers):
        rule = rules.get(f"decoder.layers.{n}.mlp.router.weight")
        if config.is_moe_layer(n) and rule is not None:
            out.append(rule.hf[0].rsplit(".", 2)[0])
    return out


def export_adapter(load: str, out: str, dtype: str = "float32", log=print) -> str:
    """Write peft's adapter folder `out` from LoRA checkpoint `load`; returns `out`. Raises
    `CheckpointError` / `HFConversionError` before `out` exists."""
    from safetensors.torch import save_file

    from .hf import DTYPES, check_export_target

    check_export_target(out, dtype)
    config, lora, adapters = read_adapters(load)
    weights = {}
    for module, (a, b) in adapters.items():
        weights[peft_key(module, "A")] = a.to(DTYPES[dtype]).contiguous()
        weights[peft_key(module, "B")] = b.to(DTYPES[dtype]).contiguous()
    targets = sorted({m.rsplit(".", 1)[-1] for m in adapters})
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora["rank"],
        "lora_alpha": lora["alpha"], "lora_dropout": lora["dropout"],
        "target_modules": targets, "use_rslora": lora["use_rslora"], **PLAIN_LORA,
        "init_lora_weights": True, "inference_mode": True,
        "base_model_name_or_path": (lora.get("base") or {}).get("path")}
    moe_blocks = _moe_blocks(config)
    if moe_blocks:  # peft would give the experts (fused or not) fresh adapters of these names
        adapter_config["exclude_modules"] = "(" + "|".join(map(re.escape, moe_blocks)) + \
            r")(\..*)?"
    tmp = f"{os.path.abspath(out)}.tmp-{secrets.token_hex(4)}"
    os.makedirs(tmp)
    try:
        save_file(weights, os.path.join(tmp, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
            json.dump(adapter_config, f, indent=2)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if moe_blocks and {"gate_proj", "up_proj", "down_proj"} & set(targets):
        log("note: this MoE model's dense MLP layers have gate_proj / up_proj / down_proj "
            "adapters; peft on transformers 5 reads those target names as the fused experts' "
            "parameters and does not load them (transformers 4's per-expert modules are kept "
            "out by exclude_modules)")
    log(f"exported {len(adapters)} LoRA adapters (rank {lora['rank']}, {', '.join(targets)}) "
        f"of {config.num_layers} layers to {out}")
    return out


def merge_adapter(load: str, out: str, dtype: str = "float32",
                  max_shard_bytes: int | None = None, log=print) -> str:
    """Write a plain HF model folder `out`: the base checkpoint LoRA checkpoint `load` was
    trained on (its recorded path, whose files must still have the recorded digest) with each
    adapter folded in, `W + s B A` (s = alpha / r, or alpha / sqrt(r) with rsLoRA), in
    float32 before the cast to `dtype`. Raises `CheckpointError` for a base made from a seed
    (no file to merge into) or a changed base, before `out` exists."""
    from .hf import DEFAULT_MAX_SHARD_BYTES, export_hf

    _, lora, adapters = read_adapters(load)
    base = lora.get("base") or {}
    if base.get("path") is None:
        raise CheckpointError(f"{load}: its base was made from --seed {base.get('seed')}, not "
                              f"loaded from a checkpoint, so there are no base weights to "
                              f"merge into; export the adapters with export-adapter")
    if base.get("format") == "gguf":
        raise CheckpointError(f"{load}: its base is the GGUF file {base['path']}, which merge "
                              f"cannot write back; export the adapters with export-adapter and "
                              f"merge them with peft (merge_and_unload) onto its transformers "
                              f"model (nothing was written)")
    if base_digest(read_metadata(base["path"])) != base.get("sha256"):
        raise CheckpointError(f"{load}: its base {base['path']} now holds other weights than "
                              f"the adapters were trained on (sha256 differs); restore it")
    if lora.get("base_quantization", "none") != "none":
        log(f"note: the adapters were trained on the base held as {lora['base_quantization']} "
            f"(QLoRA); they are folded into its float weights")
    scale = lora_scale(lora["rank"], lora["alpha"], lora["use_rslora"])
    deltas = {module + ".weight": (a, b) for module, (a, b) in adapters.items()}

    def fold(name: str, t: torch.Tensor) -> torch.Tensor:
        if name not in deltas:
            return t
        a, b = deltas[name]
        return t.float() + scale * (b @ a)

    return export_hf(base["path"], out, dtype, max_shard_bytes or DEFAULT_MAX_SHARD_BYTES,
                     log=log, adjust=fold)
