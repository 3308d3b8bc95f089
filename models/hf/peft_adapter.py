"""Read a PEFT LoRA adapter folder (`adapter_config.json` + `adapter_model.safetensors`, as
`PeftModel.save_pretrained` writes it) onto our linear layers, for serving many adapters over
one base (inference/lora.py).

Every file is untrusted: the config is read with a size cap and each field checked; weights
come only from safetensors (a pickle `adapter_model.bin` is refused), every tensor's name,
dtype and shape are checked against the base model from the header before any data is read,
and the values must be finite. PEFT's names `base_model.model.<HF module>.lora_A.weight`
(`[r, in]`) and `.lora_B.weight` (`[out, r]`) are mapped onto our layers by the same rule
table as the base weights (models/hf/rules.py): an HF module (q_proj, k_proj, v_proj, o_proj,
gate_proj, up_proj, down_proj, Phi-3's qkv_proj / gate_up_proj) is one part of one of our
linears, and a fused linear (QKV, SwiGLU's [gate; up]) gets one rank block per part: its A is
the parts' A stacked `[parts x R, in]`, its B the parts' B each in its own block of columns,
put into our fused row order by the rule (`Rule.to_native` only permutes and stacks rows, so
it takes any number of columns). Blocks are padded with zeros to `block_rank` (the server's
--max-lora-rank), which changes nothing in `B A`. The scaling (layers/lora.py `lora_scale`:
`lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`) is folded into B.

The PEFT names here (file names, `peft_key`, `lora_targets`, `PLAIN_LORA`) are the ones
checkpoint/lora_files.py writes a trained adapter with.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from layers.lora import ADAPTED_LINEARS, ALL_PARTS, lora_scale
from models.config import ModelConfig

from .rules import HFConversionError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MAX_ADAPTER_CONFIG_BYTES = 1 << 20
PEFT_PREFIX = "base_model.model."
# adapter_config.json fields of a plain LoRA adapter (peft's LoraConfig) and their values;
# another value (DoRA, biases, per-module ranks, ...) is not plain LoRA
PLAIN_LORA = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "lora_bias": False,
              "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}}
# further adapter_config.json fields that change what the adapter is (replicated layers,
# adapters on parameters or token rows, QA-LoRA, aLoRA, some layers only): refused when set
NOT_PLAIN = {"layer_replication": None, "target_parameters": None,
             "trainable_token_indices": None, "use_qalora": False,
             "alora_invocation_tokens": None, "layers_to_transform": None}
_FLOAT = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def peft_key(module: str, half: str) -> str:
    """peft's tensor name of half `half` ("A": `[r, in]`, "B": `[out, r]`) of the adapter on
    HF module `module` (e.g. `model.layers.0.self_attn.q_proj`)."""
    return f"{PEFT_PREFIX}{module}.lora_{half}.weight"


class AdapterError(HFConversionError):
    """A LoRA adapter that cannot be served; the message names the file, field or tensor and
    what to do."""


@dataclass(frozen=True)
class Target:
    """One of our linear layers (`module`, global name) and the HF modules it is made of
    (`parts`, e.g. q_proj/k_proj/v_proj of one layer), with the rule that stacks the parts'
    rows in our order (`fuse`) and the parts' dense `[out, in]` shapes."""

    module: str
    parts: tuple[str, ...]
    fuse: object
    shapes: tuple[tuple[int, int], ...]


def lora_targets(config: ModelConfig) -> dict[str, Target]:
    """`{our module name: Target}` for every linear an adapter may target in a model of
    `config` (all layers). Raises `AdapterError` for a family whose HF linears are not
    `[out, in]` nn.Linear weights (GPT-2's Conv1D, T5). A mixture-of-experts model's
    experts take none (layers/lora.py: MoE layers keep no adapters), their attention does."""
    from . import family_for, hf_shapes

    fam = family_for(config)
    name = fam.__name__.rsplit(".", 1)[-1]
    if name in ("gpt2", "t5"):
        raise AdapterError(f"PEFT LoRA adapters map onto the Llama-style families (Llama, "
                           f"Mistral, Qwen2/3, Phi-3, OLMo2, Gemma, MoE attention), not {name}")
    shapes = hf_shapes(config)
    out = {}
    for rule in fam.rules(config):
        module = rule.native.removesuffix(".weight")
        if rule.native.endswith(".weight") and module.endswith(ADAPTED_LINEARS) and \
                all(h.endswith(".weight") for h in rule.hf):
            out[module] = Target(module, tuple(h.removesuffix(".weight") for h in rule.hf),
                                 rule.to_native, tuple(shapes[h] for h in rule.hf))
    return out


@dataclass
class Adapter:
    """A read adapter: `weights[our module] = (A [parts x block_rank, in], B [out, parts x
    block_rank])`, dense (all tp ranks), scaling folded into B; `rank` its r."""

    path: str
    rank: int
    weights: dict


@dataclass(frozen=True)
class AdapterSettings:
    """The checked fields of a plain LoRA `adapter_config.json`: rank `r`, `lora_alpha`,
    `lora_dropout`, `use_rslora`, and the scale they give (`scaling`, layers/lora.py)."""

    r: int
    lora_alpha: float
    lora_dropout: float
    use_rslora: bool

    @property
    def scaling(self) -> float:
        return lora_scale(self.r, self.lora_alpha, self.use_rslora)


def _config(path: str, max_rank: int) -> AdapterSettings:
    """The adapter config in folder `path`, every field checked."""
    from .files import read_json

    where = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(where):
        raise AdapterError(f"{path} has no {ADAPTER_CONFIG}; pass the folder "
                           f"PeftModel.save_pretrained wrote")
    d = read_json(where, MAX_ADAPTER_CONFIG_BYTES)
    if type(d) is not dict:
        raise AdapterError(f"{where} is not a JSON object; use the adapter's own config")
    if d.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type {d.get('peft_type')!r} is not supported; only "
                           f"plain LoRA adapters (peft_type LORA) are read")
    r, alpha = d.get("r"), d.get("lora_alpha", d.get("r"))
    if type(r) is not int or r < 1:
        raise AdapterError(f"{where}: r {r!r} must be a positive integer")
    if r > max_rank:
        raise AdapterError(f"{where}: the adapter's rank {r} exceeds --max-lora-rank "
                           f"{max_rank}; restart the server with --max-lora-rank {r} or more")
    if type(alpha) not in (int, float) or not math.isfinite(alpha):
        raise AdapterError(f"{where}: lora_alpha {alpha!r} must be a finite number")
    for key, plain in {**PLAIN_LORA, **NOT_PLAIN}.items():
        value = d.get(key, plain)
        if value not in (plain, None, [], {}, False, "none"):
            raise AdapterError(f"{where}: {key}={value!r} is not supported; only plain LoRA "
                               f"adapters are read (no DoRA, biases, per-module ranks or "
                               f"modules_to_save): train or export the adapter without it")
    rslora = d.get("use_rslora", False)
    if type(rslora) is not bool:
        raise AdapterError(f"{where}: use_rslora {rslora!r} must be true or false")
    dropout = d.get("lora_dropout", 0.0)
    if type(dropout) not in (int, float) or not 0.0 <= dropout < 1.0:
        raise AdapterError(f"{where}: lora_dropout {dropout!r} must be a number in [0, 1)")
    return AdapterSettings(r, alpha, float(dropout), rslora)


def read_peft_tensors(path: str, config: ModelConfig, max_rank: int
                      ) -> tuple[AdapterSettings, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """`(settings, {HF module: (A [r, in], B [out, r])})` of the PEFT adapter in folder
    `path` for a base of `config`: the tensors as stored (float32, scaling not applied),
    HF modules by their names in `lora_targets(config)`. Raises `AdapterError` (one line: the
    file, the problem, the fix) for a missing or pickle-only weights file, an unreadable or
    truncated safetensors file, an unknown tensor or target module, a missing lora_A /
    lora_B half, a dtype that is not floating, a shape other than the base needs, a rank
    above `max_rank`, a non-finite value, or an unsupported config field (DoRA, ...)."""
    from .files import _inside, _safetensors

    if not os.path.isdir(path):
        raise AdapterError(f"the LoRA adapter {path!r} is not a folder; pass the folder "
                           f"holding {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    settings = _config(path, max_rank)
    r = settings.r
    if not os.path.exists(os.path.join(path, ADAPTER_WEIGHTS)):
        pickled = os.path.exists(os.path.join(path, "adapter_model.bin"))
        raise AdapterError(f"{path} has no {ADAPTER_WEIGHTS}" + (
            " (only a pickle adapter_model.bin, refused: weight files are untrusted); save "
            "it with safe_serialization=True" if pickled else "; save the adapter with peft"))
    try:
        where = _inside(path, ADAPTER_WEIGHTS)
        handle = _safetensors(where)
    except HFConversionError as e:
        raise AdapterError(str(e)) from None
    targets = lora_targets(config)
    part_of = {p: (t, i) for t in targets.values() for i, p in enumerate(t.parts)}
    found: dict[str, dict] = {}
    for key in handle.keys():
        module, _, half = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if not key.startswith(PEFT_PREFIX) or half not in ("A.weight", "B.weight") or \
                module not in part_of:
            raise AdapterError(f"{where}: tensor {key!r} is not a LoRA weight of a linear this "
                               f"model has (targetable: {', '.join(ALL_PARTS)} of layers "
                               f"0..{config.num_layers - 1}); use an adapter made for this base")
        target, i = part_of[module]
        out_f, in_f = target.shapes[i]
        want = (r, in_f) if half == "A.weight" else (out_f, r)
        piece = handle.get_slice(key)
        if piece.get_dtype() not in _FLOAT:
            raise AdapterError(f"{where}: tensor {key!r} has dtype {piece.get_dtype()}, not a "
                               f"float (F32, F16, BF16); the file is corrupt")
        if tuple(piece.get_shape()) != want:
            raise AdapterError(f"{where}: tensor {key!r} has shape {list(piece.get_shape())}, "
                               f"the base model and r={r} need {list(want)}; use an adapter "
                               f"made for this base")
        found.setdefault(module, {})[half[0]] = key
    if not found:
        raise AdapterError(f"{where} holds no LoRA weights; save the adapter with peft")
    for module, halves in found.items():
        if len(halves) != 2:
            raise AdapterError(f"{where}: {module} has lora_{next(iter(halves))} but not "
                               f"lora_{'B' if 'A' in halves else 'A'}; the file is incomplete")
    return settings, {module: (_finite(handle, keys["A"], where),
                               _finite(handle, keys["B"], where))
                      for module, keys in found.items()}


def read_peft_adapter(path: str, config: ModelConfig, max_rank: int,
                      block_rank: int | None = None, dtype=torch.float32) -> Adapter:
    """The PEFT adapter in folder `path` for a base of `config` (see the module docstring),
    its blocks padded to `block_rank` (default its own r), in `dtype`. Raises `AdapterError`
    as `read_peft_tensors`."""
    settings, found = read_peft_tensors(path, config, max_rank)
    r, block = settings.r, block_rank or settings.r
    weights = {}
    for target in lora_targets(config).values():
        if not any(p in found for p in target.parts):
            continue
        n = len(target.parts)
        a = torch.zeros(n * block, target.shapes[0][1], dtype=torch.float32)
        bs = []
        for i, (part, (out_f, _)) in enumerate(zip(target.parts, target.shapes)):
            b = torch.zeros(out_f, n * block, dtype=torch.float32)
            if part in found:
                a[i * block:i * block + r] = found[part][0]
                b[:, i * block:i * block + r] = found[part][1] * settings.scaling
            bs.append(b)
        weights[target.module] = (a.to(dtype), target.fuse(bs).to(dtype))
    return Adapter(path, r, weights)


def _finite(handle, key: str, where: str) -> torch.Tensor:
    t = handle.get_tensor(key).float()
    if not torch.isfinite(t).all():
        raise AdapterError(f"{where}: tensor {key!r} holds NaN or infinite values; the "
                           f"adapter is broken, train or export it again")
    return t
