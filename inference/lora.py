"""The LoRA adapters a replica serves (infer.py --enable-lora; vLLM's LoRA manager, smaller):
`max_loras` slots of stacked A/B weights on every targeted linear of this rank's stage
(layers/multi_lora.py), adapters read from PEFT folders (models/hf/peft_adapter.py) into
free slots, and the slot of each row of a forward.

Every rank of a replica loads and unloads the same adapters in the same order (the control
loop broadcasts the commands), so slot numbers and load ids agree without communication.
An adapter's `load_id` (a counter over loads) keys its requests' prefix-cache blocks
(inference/block_manager.py), so the same prompt under two adapters -- or under an adapter
unloaded and another loaded under its name -- never shares KV blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from layers.multi_lora import LoRABatch, MultiLoRA
from layers.sharding import shard_tensor


class LoRAError(ValueError):
    """An adapter command that cannot be done (unknown name, no free slot, in use, a bad
    adapter folder); the message says what to do. `status`: the HTTP status it answers."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class LoadedAdapter:
    name: str
    path: str
    slot: int
    load_id: int
    rank: int


def _part_rows(target, layer) -> list[torch.Tensor] | None:
    """This rank's output rows of each HF part of `target`'s fused linear `layer` (the rule's
    row order, cut over TP as the base weight is); None for one part or a row-parallel
    layer."""
    if len(target.parts) == 1 or hasattr(layer, "input_size_per_partition"):
        return None
    ids = target.fuse([torch.full((out_f, 1), float(i)) for i, (out_f, _) in
                       enumerate(target.shapes)])
    local = shard_tensor(ids, layer.weight)[:, 0]
    return [torch.nonzero(local == i).flatten() for i in range(len(target.parts))]


class LoRAManager:
    """The adapters of one replica over this rank's `model` stage.

    Args:
        model: this rank's `GPTModel` stage (decoder-only), weights loaded.
        max_loras: adapters held at once (--max-loras), in slots 1..max_loras (0: the base).
        max_lora_rank: the largest adapter rank accepted (--max-lora-rank); every HF part of
            a targeted linear gets a block of this many ranks.
    Raises `LoRAError` for max_loras or max_lora_rank < 1, or a model family adapters are not
    served for (models/hf/peft_adapter.py `lora_targets`).
    """

    def __init__(self, model, max_loras: int, max_lora_rank: int):
        from models.hf.peft_adapter import AdapterError, lora_targets

        if max_loras < 1 or max_lora_rank < 1:
            raise LoRAError(f"--max-loras ({max_loras}) and --max-lora-rank ({max_lora_rank}) "
                            f"must be >= 1")
        self.config, self.max_loras, self.max_rank = model.config, max_loras, max_lora_rank
        try:
            targets = lora_targets(model.config)
        except AdapterError as e:
            raise LoRAError(str(e)) from None
        self.batch = LoRABatch()
        self.layers: dict[str, MultiLoRA] = {}
        modules = dict(model.named_modules())
        for name, target in targets.items():
            if name in modules:  # this stage's layers only
                self.layers[name] = MultiLoRA(modules[name], max_lora_rank, max_loras,
                                              self.batch, _part_rows(target, modules[name]))
        p = next(model.parameters())
        self.dtype = p.dtype if p.is_floating_point() else torch.float32
        self.adapters: dict[str, LoadedAdapter] = {}
        self.loads = 0

    @property
    def nbytes(self) -> int:
        """Bytes the slots take on this rank."""
        return sum(m.nbytes for m in self.layers.values())

    def summary(self) -> str:
        return (f"LoRA: {self.max_loras} adapter slots of rank <= {self.max_rank} on "
                f"{len(self.layers)} linear layers ({self.nbytes / 2**20:,.1f} MiB on this "
                f"rank)")

    def load(self, name: str, path: str) -> LoadedAdapter:
        """Read the PEFT adapter folder `path` into a free slot as `name`. Raises `LoRAError`
        (400) for a name already loaded, no free slot, or an adapter refused by
        `read_peft_adapter`; nothing changes then."""
        from models.hf.peft_adapter import read_peft_adapter
        from models.hf.rules import HFConversionError

        if not isinstance(name, str) or not name:
            raise LoRAError("lora_name must be a non-empty string")
        if name in self.adapters:
            raise LoRAError(f"an adapter named {name!r} is loaded already; unload it first or "
                            f"pick another name")
        free = sorted(set(range(1, self.max_loras + 1)) -
                      {a.slot for a in self.adapters.values()})
        if not free:
            raise LoRAError(f"all {self.max_loras} adapter slots are taken "
                            f"({sorted(self.adapters)}); unload one, or restart with a larger "
                            f"--max-loras")
        try:
            adapter = read_peft_adapter(path, self.config, self.max_rank, self.max_rank,
                                        self.dtype)
        except (HFConversionError, OSError) as e:  # AdapterError, a refused file
            raise LoRAError(f"cannot load LoRA adapter {name!r}: {e}") from None
        slot = free[0]
        for module, layer in self.layers.items():
            a, b = adapter.weights.get(module, (None, None))
            if a is not None:
                w = layer.layer.weight
                a, b = (shard_tensor(a, w), b) if layer.row else (a, shard_tensor(b, w))
            layer.set(slot - 1, a, b)
        self.loads += 1
        loaded = LoadedAdapter(name, path, slot, self.loads, adapter.rank)
        self.adapters[name] = loaded
        return loaded

    def unload(self, name: str) -> None:
        """Free `name`'s slot. Raises `LoRAError` (404) when no such adapter is loaded. The
        caller refuses an adapter that running requests still use (`Engine.unload_lora`)."""
        if name not in self.adapters:
            raise LoRAError(f"no LoRA adapter named {name!r} is loaded (loaded: "
                            f"{sorted(self.adapters)})", status=404)
        a = self.adapters.pop(name)
        for layer in self.layers.values():
            layer.set(a.slot - 1, None, None)

    def get(self, name: str | None) -> LoadedAdapter | None:
        """The adapter `name` (None: the base). Raises `LoRAError` (404) for an unknown one."""
        if name is None:
            return None
        if name not in self.adapters:
            raise LoRAError(f"no LoRA adapter named {name!r} is loaded", status=404)
        return self.adapters[name]

    def bind(self, slots: list[int], device) -> None:
        """The slots of the next forward's rows (0: base); all 0 skips the adapters."""
        self.batch.bind([s - 1 for s in slots], device)
