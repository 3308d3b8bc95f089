"""Hugging Face conversion maps: config fields and tensor names of each supported HF
architecture, both directions, beside our model families (`GPTModel`, `T5Model`).

- `config_from_hf(config_dict) -> ModelConfig`, refusing (with `HFConversionError`) every
  field we cannot represent: another model_type, MoE, unknown RoPE scaling, a quantization
  config other than GGUF, a sliding window shorter than the sequence, ...
- `config_to_hf(model_config) -> dict` of transformers config kwargs (model_type included).
- `to_native(config, get, names)` / `to_hf(config, get)`: stream `(name, tensor)` pairs one
  parameter at a time through the architecture's `Rule` table (models/hf/rules.py).

Supported: GPT2LMHeadModel (gpt2), LlamaForCausalLM (llama), MistralForCausalLM (mistral),
Qwen2ForCausalLM (qwen2), T5ForConditionalGeneration (t5, v1.0 and v1.1). File formats
(safetensors, .bin, GGUF) are in models/hf/files.py.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch

from models.config import ConfigError, ModelConfig

from . import gpt2, llama, t5
from .rules import HFConversionError, Rule  # noqa: F401

FAMILIES = {mt: fam for fam in (gpt2, llama, t5) for mt in fam.MODEL_TYPES}
# config.json fields that mean mixture-of-experts (not supported)
_MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")


def config_from_hf(d: dict) -> ModelConfig:
    """Our `ModelConfig` for an HF `config.json` dict. Raises `HFConversionError` naming the
    unsupported field."""
    mt = d.get("model_type")
    if mt not in FAMILIES:
        raise HFConversionError(
            f"config.json model_type {mt!r} is not supported; supported: {sorted(FAMILIES)}")
    archs = d.get("architectures") or []
    known = set(FAMILIES[mt].ARCHITECTURES.values())
    bad = [a for a in archs if a not in known]
    if bad:
        raise HFConversionError(f"config.json architectures {bad} is not supported for "
                                f"model_type {mt!r} (supported: {sorted(known)})")
    for field in _MOE_FIELDS:
        if d.get(field):
            raise HFConversionError(f"config.json {field}={d[field]}: mixture-of-experts models "
                                    f"are not supported")
    quant = d.get("quantization_config")
    if quant and (quant.get("quant_method") if isinstance(quant, dict) else quant) != "gguf":
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise HFConversionError(
            f"config.json quantization_config (quant_method {method!r}) is not supported: "
            f"convert the unquantized (or GGUF) model")
    config = FAMILIES[mt].config_from_hf(d)
    try:
        config.validate()
    except ConfigError as e:
        raise HFConversionError(f"config.json of this {mt} model: {e}") from None
    return config


def family_for(c: ModelConfig):
    """The family module that can represent `c` in HF form; `HFConversionError` if none."""
    reasons = {}
    for fam in (gpt2, llama, t5):
        why = fam.conditions(c)
        if not why:
            return fam
        reasons[fam.__name__.rsplit(".", 1)[-1]] = why
    raise HFConversionError("this model has no Hugging Face equivalent: " + "; ".join(
        f"not {name}: {', '.join(why)}" for name, why in reasons.items()))


def config_to_hf(c: ModelConfig) -> dict:
    """transformers config kwargs (with `model_type`, `architectures`) for `c`."""
    return family_for(c).config_to_hf(c)


def rules_for(c: ModelConfig, model_type: str | None = None) -> list[Rule]:
    fam = FAMILIES[model_type] if model_type else family_for(c)
    return fam.rules(c)


def to_native(c: ModelConfig, model_type: str, get: Callable[[str], torch.Tensor],
              names: Iterable[str]) -> dict[str, Callable[[], torch.Tensor]]:
    """`{our name: function -> dense tensor}` for every parameter of `c`, reading HF tensors
    with `get` only when called (streaming). `names` are the tensor names of the HF files.

    Checked before anything is read: raises `HFConversionError` for a missing tensor (e.g.
    an untied model without lm_head.weight) and for tensors the model would not use.
    """
    fam = FAMILIES[model_type]
    spelled = {fam.normalize(n): n for n in names}
    out, used = {}, set()
    for rule in fam.rules(c):
        missing = [n for n in rule.hf if n not in spelled]
        if missing:
            raise HFConversionError(
                f"the checkpoint has no tensor {missing[0]!r}, which this {model_type} config "
                f"needs (for our {rule.native}); the weights do not match config.json")
        used.update(rule.hf)
        out[rule.native] = (lambda rule=rule: rule.to_native([get(spelled[n]) for n in rule.hf]))
    tied = {"lm_head.weight"} if not c.untie_embeddings_and_output_weights else set()
    extra = sorted(n for n in set(spelled) - used - tied if not n.endswith(fam.IGNORED_SUFFIXES))
    if extra:
        raise HFConversionError(
            f"the checkpoint holds {len(extra)} tensor(s) this {model_type} config does not "
            f"use, e.g. {extra[:3]}; refusing to drop weights silently (is config.json the "
            f"right one?)")
    return out


def to_hf(c: ModelConfig, get: Callable[[str], torch.Tensor]
          ) -> Iterator[tuple[str, torch.Tensor]]:
    """`(HF name, tensor)` for every HF weight of `c`, reading our dense tensors with `get`."""
    for rule in family_for(c).rules(c):
        yield from zip(rule.hf, rule.to_hf(get(rule.native)))
