"""Multi-token prediction (MTP): DeepSeek-V3 technical report (arXiv:2412.19437) sec. 2.2.

`D = mtp_num_layers` sequential modules on the last pipeline stage. Module k (1-based) sees,
at position i, the previous depth's hidden state h_i^{k-1} (h^0: the main model's output,
after its final norm) and the embedding of token t_{i+k}:

    h'_i^k = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h_i^{k-1})]          (eq. 21)
    h_{1:T-k}^k = TRM_k(h'_{1:T-k}^k)                                  (eq. 22)
    P_{i+k+1}^k = OutHead(h_i^k)                                       (eq. 23)
    L_MTP^k = -1/T sum_i log P_{i+k+1}^k[t_{i+k+1}]                   (eq. 24)
    L_MTP = lambda / D sum_k L_MTP^k                                   (eq. 25)

M_k is `eh_proj` `[h, 2h]`; its input is [embedding; hidden], the order of the released
checkpoints and Megatron-Core (the report writes the two halves the other way round: the same
model with M_k's columns swapped). TRM_k is one transformer layer of the model's own spec
(an MoE layer when the model's last layer is one), numbered `num_layers + k - 1`. Each module
ends with its own norm (HF's `shared_head.norm`), whose output is both h^k and the input of
the shared output head; Emb and OutHead are the main model's (HF's checkpoints keep copies
of both in the MTP layer; this module keeps none on a one-stage model). The lookup of
t_{i+k} is the word embedding alone (no embedding dropout); the layer's own dropouts are
keyed by its name `mtp.layers.{k-1}.transformer_layer`, the same at every layout.

Sequence parallelism: norms, eh_proj (replicated over TP, `ReplicatedLinear`) and the
layer run on sequence shards `[s/tp, b, h]` like the main layers. Under pipeline parallelism
the last stage looks tokens up in its own copy of the word embedding (`word_embeddings`,
tagged like the tied output layer's copy: same init, gradient summed with stage 0's). Not
with context parallelism (the shift by k crosses the ranks' parts: run_config/checks.py).

The loss enters the model's per-token loss so that its value is unchanged and its gradient
is lambda / D x the gradient of each depth's per-token loss, aligned at the position of its
target token, so the schedule's loss mask and 1 / tokens apply to it as to the main loss
(Megatron-Core's MTPLossAutoScaler, without an autograd function: `mtp_objective`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from layers.embedding import VocabParallelEmbedding
from layers.linear import ReplicatedLinear
from layers.norm import build_norm
from layers.transformer import TransformerLayer
from parallel_state import get_tensor_model_parallel_world_size

from .config_mtp import mtp_depths


class MultiTokenPredictionLayer(nn.Module):
    """Depth k: enorm, hnorm, eh_proj, one transformer layer and the final norm
    (eq. 21-22). `forward(hidden [s, b, h], embedded [s, b, h])` -> h^k `[s, b, h]` (all
    `[s/tp, b, h]` under sequence parallelism)."""

    def __init__(self, config, depth: int, sequence_parallel: bool):
        super().__init__()
        h = config.hidden_size
        self.enorm = build_norm(config, sequence_parallel=sequence_parallel)
        self.hnorm = build_norm(config, sequence_parallel=sequence_parallel)
        self.eh_proj = ReplicatedLinear(2 * h, h, sequence_parallel=sequence_parallel)
        self.transformer_layer = TransformerLayer(config, config.num_layers + depth - 1,
                                                  sequence_parallel=sequence_parallel)
        self.final_layernorm = build_norm(config, sequence_parallel=sequence_parallel)

    def forward(self, hidden, embedded, rotary=None, attention_mask=None):
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        x = self.transformer_layer(x, rotary=rotary, attention_mask=attention_mask)
        return self.final_layernorm(x)


class MultiTokenPrediction(nn.Module):
    """The D depths of a model's last stage (`layers.0` .. `layers.{D-1}`), with a copy of
    the word embedding when the stage has none (`own_embedding`). Parameter names
    `mtp.layers.{k-1}.{enorm,hnorm,eh_proj,transformer_layer,final_layernorm}` are
    Megatron-Core's."""

    def __init__(self, config, padded_vocab_size: int, *, sequence_parallel: bool,
                 own_embedding: bool):
        super().__init__()
        sp = sequence_parallel and get_tensor_model_parallel_world_size() > 1
        self.layers = nn.ModuleDict({str(k - 1): MultiTokenPredictionLayer(config, k, sp)
                                     for k in range(1, mtp_depths(config) + 1)})
        self.word_embeddings = VocabParallelEmbedding(
            padded_vocab_size, config.hidden_size, vocab_size=config.vocab_size,
            reduce_scatter_embeddings=sp) if own_embedding else None
        # per depth: the masked loss sums since the last `take_loss_sums` (for the log)
        self.register_buffer("loss_sums", torch.zeros(len(self.layers), dtype=torch.float64),
                             persistent=False)
        self.last_losses: torch.Tensor | None = None  # [D, b, s] of the last forward

    def forward(self, hidden, input_ids, embed, rotary=None, attention_mask=None
                ) -> list[torch.Tensor]:
        """`hidden [s, b, h]` (SP: `[s/tp, b, h]`): h^0, the main model's normed output;
        `input_ids [b, s]`; `embed(ids [s, b]) -> [s, b, h]` the word embedding (SP: its
        reduce-scattered shard). Returns h^1..h^D, each shaped as `hidden`."""
        if self.word_embeddings is not None:
            embed = self.word_embeddings
        out, ids = [], input_ids
        for layer in self.layers.values():
            ids = F.pad(ids[:, 1:], (0, 1))  # token i+k at i; id 0 past the end (no target)
            hidden = layer(hidden, embed(ids.t()), rotary=rotary, attention_mask=attention_mask)
            out.append(hidden)
        return out

    def record(self, loss_mask: torch.Tensor) -> None:
        """Add the last forward's per-depth losses under `loss_mask [b, s]` to `loss_sums`."""
        if self.last_losses is not None:
            self.loss_sums += (self.last_losses * loss_mask.to(self.last_losses)).sum(
                dim=(1, 2)).to(self.loss_sums)
            self.last_losses = None


def mtp_objective(main: torch.Tensor, depth_losses: list[torch.Tensor],
                  factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(`main [b, s]` with the MTP loss's gradient attached, the depths' losses `[D, b, s]`
    aligned at their targets, detached).

    `depth_losses[k-1] [b, s]`: depth k's loss at position i (target t_{i+k+1}, 0 where it
    is past the end). Each is moved k positions right, to the position of its target in the
    main loss (whose label at j is t_{j+1}), so the loss mask at j masks both. The result's
    value is `main` exactly (`x - x.detach()` is 0); its gradient is that of
    `main + factor / D sum_k aligned_k` (eq. 25)."""
    aligned = [F.pad(loss[:, :loss.shape[1] - k], (k, 0))
               for k, loss in enumerate(depth_losses, start=1)]
    extra = sum(a - a.detach() for a in aligned) * (factor / len(aligned))
    return main + extra, torch.stack(aligned).detach()


def mtp_labels(labels: torch.Tensor, depths: int) -> torch.Tensor:
    """`[(1 + D) b, s]`: `labels [b, s]` then, for depth k, the labels shifted left by k
    (position i holds t_{i+k+1}; -100, ignored, past the end)."""
    rows = [labels] + [F.pad(labels[:, k:], (0, k), value=-100) for k in range(1, depths + 1)]
    return torch.cat(rows)


def take_loss_sums(modules) -> torch.Tensor | None:
    """The summed `loss_sums [D]` of the MTP modules in `modules` (model chunks), reset;
    None when none holds one."""
    found = [m for chunk in modules for m in chunk.modules()
             if isinstance(m, MultiTokenPrediction)]
    if not found:
        return None
    total = sum(m.loss_sums.clone() for m in found)
    for m in found:
        m.loss_sums.zero_()
    return total
