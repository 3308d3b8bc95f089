"""The trainer's side of a mixture of experts (layers/moe/): each step's auxiliary-loss weight,
the expert load collected after the step, DeepSeek-V3's expert-bias update, and the per-layer
load reported every log interval (Megatron's `track_moe_metrics`).

Per training step (training/loop.py `train_step`):

- before the schedule, `set_aux_loss_scale(micro_batch_size / global_batch_size)`: each
  microbatch's auxiliary and z losses enter the gradient with weight 1 / the number of
  microbatches of the global batch (over all DP ranks), so the objective is their mean at any
  layout; the batch can grow (ramp-up), so it is set every step;
- after the optimizer step (or its skip), `collect_expert_load`: the step's routed tokens and
  dropped tokens per expert and its mean aux / z loss per MoE layer, summed over the
  data-parallel ranks (one all-reduce);
- on an applied step only, `update_expert_bias` with those counts, and the load joins the
  window the next log line reports. A step the non-finite guard skips changes nothing: the
  weights, the Adam moments and the expert bias stay as they were, and its load (routing of a
  step whose activations may be NaN) is dropped. (Megatron moves the bias in
  `finalize_model_grads`, before it knows whether the step will be skipped.)

Reported (`ExpertLoadLog.report`, every log line; a collective over the pipeline ranks, which
hold different layers): per MoE layer `layer_<n>` (0-based global layer number, as in the
parameter names), over the applied steps since the previous line, `tokens_per_expert` (routed
copies, top-k choices before capacity dropping) and `dropped_per_expert`, their `min_tokens`,
`max_tokens`, `dropped_tokens`, `imbalance` = max / mean tokens per expert (1.0: balanced),
and the mean raw (coefficient-free) `aux_loss` / `z_loss` per step where their coefficient is
on; the largest imbalance with its layer, the total dropped and the layers' mean losses at the
top level of the record; and `moe imbalance max 1.23 (layer 2) dropped 0` in the log line.
"""
from __future__ import annotations

import torch

import parallel_state as ps
from layers.moe import collect_expert_load, moe_layers, set_aux_loss_scale, update_expert_bias
from parallel_state import collectives


class ExpertLoadLog:
    """The MoE layers of this rank's `chunks` and their load since the last report.

    Building it drops what the layers counted before training (the start-up's activation
    measurement runs a training-mode forward): a collective over DP, like `after_step`."""

    def __init__(self, chunks: list, model_config):
        self.config = model_config
        self.layers = moe_layers(chunks)
        # the multi-token-prediction layers are numbered after the model's (models/mtp.py)
        self.moe_numbers = [n for n in range(model_config.num_layers +
                                             (model_config.mtp_num_layers or 0))
                            if model_config.is_moe_layer(n)]
        self._reset()
        collect_expert_load(self.layers)

    def _reset(self) -> None:
        e = self.config.num_moe_experts or 0
        # per local layer: [tokens per expert, dropped per expert, aux sum, z sum]
        self.window = {m.layer_number: torch.zeros(2 * e + 2, dtype=torch.float64)
                       for m in self.layers}
        self.steps = 0

    def before_step(self, global_batch_size: int, micro_batch_size: int) -> None:
        """Weight of one microbatch's aux and z losses: 1 / microbatches of the global batch."""
        set_aux_loss_scale(self.layers, micro_batch_size / global_batch_size)

    def after_step(self, applied: bool) -> None:
        """Collect the step's load (collective over DP); on an applied step move the expert
        bias and add the load to the window (module docstring)."""
        loads = collect_expert_load(self.layers)
        if not applied:
            return
        update_expert_bias(self.layers, loads)
        for load in loads:
            row = self.window[load.layer_number]
            e = load.tokens_per_expert.numel()
            row[:e] += load.tokens_per_expert.double().cpu()
            row[e:2 * e] += load.dropped_per_expert.double().cpu()
            row[2 * e:] += torch.tensor([load.aux_loss or 0.0, load.z_loss or 0.0],
                                        dtype=torch.float64)
        self.steps += 1

    def report(self) -> tuple[dict, str]:
        """(metrics-record fields, log-line part) of the window, which then starts anew; empty
        for a dense model. Collective over the pipeline group."""
        if not self.moe_numbers:
            return {}, ""
        m, e = self.config, self.config.num_moe_experts
        table = torch.zeros(m.num_layers + (m.mtp_num_layers or 0), 2 * e + 2,
                            dtype=torch.float64)
        for n, row in self.window.items():
            table[n] = row
        if ps.get_pipeline_model_parallel_world_size() > 1:  # each layer lives on one stage
            table = table.to(ps.get_device())
            collectives.all_reduce(table, group=ps.get_pipeline_model_parallel_group())
            table = table.cpu()
        steps = max(self.steps, 1)
        aux_on, z_on = (m.moe_aux_loss_coeff or 0) > 0, (m.moe_z_loss_coeff or 0) > 0
        layers = {}
        for n in self.moe_numbers:
            tokens, dropped = table[n, :e].long(), table[n, e:2 * e].long()
            mean = tokens.double().mean()
            layers[f"layer_{n}"] = {
                "tokens_per_expert": tokens.tolist(), "dropped_per_expert": dropped.tolist(),
                "min_tokens": int(tokens.min()), "max_tokens": int(tokens.max()),
                "imbalance": float(tokens.max() / mean) if mean > 0 else 0.0,
                "dropped_tokens": int(dropped.sum()),
                **({"aux_loss": float(table[n, 2 * e]) / steps} if aux_on else {}),
                **({"z_loss": float(table[n, 2 * e + 1]) / steps} if z_on else {})}
        self._reset()
        return _summary(layers, aux_on, z_on)


def _summary(layers: dict, aux_on: bool, z_on: bool) -> tuple[dict, str]:
    """The record fields and log-line part of the per-layer `layers` (see `report`)."""
    worst = max(layers, key=lambda k: layers[k]["imbalance"])
    dropped = sum(v["dropped_tokens"] for v in layers.values())
    rec = {"moe_imbalance_max": layers[worst]["imbalance"],
           "moe_imbalance_max_layer": int(worst.removeprefix("layer_")),
           "moe_dropped_tokens": dropped}
    line = (f"moe imbalance max {layers[worst]['imbalance']:.2f} ({worst.replace('_', ' ')}) "
            f"dropped {dropped}")
    for on, key, label in ((aux_on, "aux_loss", "aux"), (z_on, "z_loss", "z")):
        if on:
            rec[f"moe_{key}"] = sum(v[key] for v in layers.values()) / len(layers)
            line += f" {label} {rec[f'moe_{key}']:.4g}"
    rec["moe"] = layers
    return rec, line
