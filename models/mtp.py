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
tagged like the tied output layer's copy: same init, gradient summed with stage 0's).

Shifts: depth k reads, at position i, token t_{i+k}, label t_{i+k+1} and loss mask i+k
(`mtp_shifted`: `[b, D, s]`). Training rolls them on the whole sequence before it is split
over context-parallel ranks (training/batches.py), so a rank's part holds the shifted
values of its own positions, with no exchange between ranks; the depth's layer attends
through the same CP attention (ring or all-gather) as the main layers (Megatron-Core rolls
with a CP-aware `roll_tensor` inside the model instead). Without them the model shifts its
own `[b, s]` (one CP rank only).

The MTP loss adds to the schedule's loss a term whose value is 0 and whose gradient is
lambda / D x the gradient of each depth's per-token loss under its shifted loss mask, so
the schedule's 1 / tokens applies to it as to the main loss and the logged loss stays the
main loss (Megatron-Core's MTPLossAutoScaler, without an autograd function:
`MultiTokenPrediction.objective`).
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

    def __init__(self, config, depth: int, sequence_parallel: bool, cp_group=None,
                 cp_comm_type: str = "p2p"):
        super().__init__()
        h = config.hidden_size
        self.enorm = build_norm(config, sequence_parallel=sequence_parallel)
        self.hnorm = build_norm(config, sequence_parallel=sequence_parallel)
        self.eh_proj = ReplicatedLinear(2 * h, h, sequence_parallel=sequence_parallel)
        self.transformer_layer = TransformerLayer(config, config.num_layers + depth - 1,
                                                  sequence_parallel=sequence_parallel,
                                                  cp_group=cp_group, cp_comm_type=cp_comm_type)
        self.final_layernorm = build_norm(config, sequence_parallel=sequence_parallel)

    def forward(self, hidden, embedded, rotary=None, attention_mask=None):
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        x = self.transformer_layer(x, rotary=rotary, attention_mask=attention_mask)
        return self.final_layernorm(x)


class MultiTokenPrediction(nn.Module):
    """The D depths of a model's last stage (`layers.0` .. `layers.{D-1}`), with a copy of
    the word embedding when the stage has none (`own_embedding`). Parameter names
    `mtp.layers.{k-1}.{enorm,hnorm,eh_proj,transformer_layer,final_layernorm}` are
    Megatron-Core's. `cp_group` / `cp_comm_type`: the layers' context-parallel attention,
    as the main layers' (layers/transformer.py)."""

    def __init__(self, config, padded_vocab_size: int, *, sequence_parallel: bool,
                 own_embedding: bool, cp_group=None, cp_comm_type: str = "p2p"):
        super().__init__()
        sp = sequence_parallel and get_tensor_model_parallel_world_size() > 1
        self.layers = nn.ModuleDict({str(k - 1): MultiTokenPredictionLayer(
            config, k, sp, cp_group=cp_group, cp_comm_type=cp_comm_type)
            for k in range(1, mtp_depths(config) + 1)})
        self.word_embeddings = VocabParallelEmbedding(
            padded_vocab_size, config.hidden_size, vocab_size=config.vocab_size,
            reduce_scatter_embeddings=sp) if own_embedding else None
        # per depth: the masked loss sums since the last `take_loss_sums` (for the log)
        self.register_buffer("loss_sums", torch.zeros(len(self.layers), dtype=torch.float64),
                             persistent=False)
        # [D, b, s] of the last training forward, with its graph (`objective` takes it)
        self.last_losses: torch.Tensor | None = None
        self.factor = config.mtp_loss_scaling_factor

    def forward(self, hidden, mtp_tokens, embed, rotary=None, attention_mask=None
                ) -> list[torch.Tensor]:
        """`hidden [s, b, h]` (SP: `[s/tp, b, h]`): h^0, the main model's normed output;
        `mtp_tokens [b, D, s]`: token t_{i+k} at position i for depth k (`mtp_shifted`);
        `embed(ids [s, b]) -> [s, b, h]` the word embedding (SP: its reduce-scattered
        shard). Returns h^1..h^D, each shaped as `hidden`."""
        if self.word_embeddings is not None:
            embed = self.word_embeddings
        out = []
        for k, layer in enumerate(self.layers.values()):
            hidden = layer(hidden, embed(mtp_tokens[:, k].t()), rotary=rotary,
                           attention_mask=attention_mask)
            out.append(hidden)
        return out

    def objective(self, mtp_loss_mask: torch.Tensor) -> torch.Tensor:
        """The MTP term of the schedule's summed loss `[]` float32 from the last forward's
        depth losses `[D, b, s]` (eq. 25): value exactly 0 (`x - x.detach()`), gradient that
        of `factor / D x sum_k sum_i mask[:, k-1, i] L^k_i`; `mtp_loss_mask [b, D, s]` is the
        loss mask shifted left by k for depth k (`mtp_shifted`). Adds the masked sums per
        depth to `loss_sums` (the log). 0 when no training forward ran since the last call."""
        losses, self.last_losses = self.last_losses, None
        if losses is None:
            return torch.zeros((), dtype=torch.float32, device=mtp_loss_mask.device)
        masked = losses.float() * mtp_loss_mask.transpose(0, 1).to(torch.float32)
        self.loss_sums += masked.detach().sum(dim=(1, 2)).to(self.loss_sums)
        return (masked - masked.detach()).sum() * (self.factor / len(self.layers))


def mtp_shifted(x: torch.Tensor, depths: int, fill) -> torch.Tensor:
    """`[b, D, s]`: row k-1 is `x [b, s]` shifted left by k (position i holds x[:, i+k];
    `fill` past the end): tokens (fill 0, an id with no target), labels (fill -100,
    ignored) and loss masks (fill 0) of the depths. Applied to whole sequences before a
    context-parallel split, it is the shift of the global sequence on every rank."""
    return torch.stack([F.pad(x[:, k:], (0, k), value=fill) for k in range(1, depths + 1)],
                       dim=1)


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
