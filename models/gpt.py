"""GPTModel: decoder-only transformer covering GPT-2 and Llama-style families by config.

GPT-2: learned positions, LayerNorm, GeLU, biases, tied embeddings. Llama: RoPE, RMSNorm,
SwiGLU, grouped-query attention, no biases, tied or untied output layer. One class, chosen by
`ModelConfig` fields. `pre_process` / `post_process` say whether this pipeline stage holds
the embedding / the final norm, output layer and loss.
"""
from __future__ import annotations

import torch
from torch import nn

from layers import (
    ColumnParallelLinear,
    LanguageModelEmbedding,
    RotaryEmbedding,
    TransformerBlock,
    initialize_parameters,
    vocab_parallel_cross_entropy,
)
from layers.attention import window_attention_masks
from layers.dropout import assign_dropout_sites
from layers.transformer import context_parallel_positions
from layers.yarn import yarn_attention_factor
from parallel_state import (get_context_parallel_group, get_context_parallel_world_size,
                            get_tensor_model_parallel_world_size)

from .config import ModelConfig
from .config_mtp import mtp_depths
from .mtp import MultiTokenPrediction, mtp_shifted

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"


def rope_scaling(config: ModelConfig) -> dict:
    """Keyword arguments of `layers.attention.rope_inv_freq` for this config's RoPE scaling."""
    if config.rope_scaling_type is None:
        return {}
    out = dict(scaling_type=config.rope_scaling_type, factor=config.rope_scaling_factor,
               low_freq_factor=config.rope_low_freq_factor,
               high_freq_factor=config.rope_high_freq_factor,
               original_max_position=config.rope_original_max_position_embeddings)
    if config.rope_scaling_type == "yarn":  # and RotaryEmbedding's factor on cos and sin
        out.update(beta_fast=config.rope_beta_fast, beta_slow=config.rope_beta_slow,
                   truncate=config.rope_yarn_truncate,
                   attention_factor=yarn_attention_factor(
                       config.rope_scaling_factor, config.rope_mscale,
                       config.rope_mscale_all_dim))
    return out


class GPTModel(nn.Module):
    """Decoder-only language model, sharded over TP (and a slice of layers for PP).

    Args:
        config: the model shape (validated for this TP size).
        pre_process: this stage holds the embedding (first pipeline stage).
        post_process: this stage holds final norm, output layer and loss (last stage).
        layer_numbers: global, 0-based layer indices held here (default: all layers).
        sequence_parallel: run norms/dropout on `[s/tp, b, h]` sequence shards.
        kv_replication: accept tp > num_query_groups by replicating KV heads (inference only;
            see layers/attention.py).
        cp_comm_type: context parallelism's attention exchange, "p2p" (ring) or "all_gather",
            used when the grid has a context-parallel size > 1 (Megatron's --cp-comm-type):
            each rank then runs its load-balanced part `[s/cp]` of every sequence
            (layers/context_parallel), with RoPE, learned positions and dropout at the global
            positions of those tokens.
    """

    def __init__(self, config: ModelConfig, *, pre_process: bool = True, post_process: bool = True,
                 layer_numbers: list[int] | None = None, sequence_parallel: bool = False,
                 kv_replication: bool = False, cp_comm_type: str = "p2p"):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.cp_group = get_context_parallel_group() \
            if get_context_parallel_world_size() > 1 else None
        config.validate(tp, kv_replication=kv_replication)
        self.config = config
        self.pre_process, self.post_process = pre_process, post_process
        self.sequence_parallel = sequence_parallel and tp > 1
        self.padded_vocab_size = config.padded_vocab_size(tp)
        self.share_embeddings_and_output_weights = not config.untie_embeddings_and_output_weights
        if layer_numbers is None:
            layer_numbers = list(range(config.num_layers))
        self.layer_numbers = list(layer_numbers)

        if pre_process:
            self.embedding = LanguageModelEmbedding(config, self.padded_vocab_size,
                                                    sequence_parallel=self.sequence_parallel)
        self.rotary = (RotaryEmbedding(config.rotary_dim, config.rotary_base,
                                       rope_scaling(config))
                       if config.position_embedding_type == "rope" else None)
        # Gemma 3: the sliding-window layers' own RoPE base (layers/attention.py SelfAttention)
        self.rotary_local = (RotaryEmbedding(config.kv_channels, config.rope_local_base_freq)
                             if self.rotary is not None and config.rope_local_base_freq
                             is not None else None)
        self.decoder = TransformerBlock(config, self.layer_numbers, post_layer_norm=post_process,
                                        sequence_parallel=self.sequence_parallel,
                                        cp_group=self.cp_group, cp_comm_type=cp_comm_type)
        if post_process:
            tied_here = self.share_embeddings_and_output_weights and pre_process
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, self.padded_vocab_size, bias=False,
                sequence_parallel=self.sequence_parallel, skip_weight=tied_here,
                full_rows=config.vocab_size)
            if self.share_embeddings_and_output_weights and not pre_process:
                # The last stage's copy of the tied embedding: same init, kept equal by an
                # all-reduce of its gradient with the first stage's copy.
                self.output_layer.weight.init_key = WORD_EMBEDDINGS
                self.output_layer.weight.shared_embedding = True
                self.output_layer.weight.pipeline_duplicate = True  # the norm counts it once
        self.mtp = None
        if post_process and mtp_depths(config):  # multi-token prediction (models/mtp.py)
            self.mtp = MultiTokenPrediction(config, self.padded_vocab_size,
                                            sequence_parallel=self.sequence_parallel,
                                            own_embedding=not pre_process,
                                            cp_group=self.cp_group, cp_comm_type=cp_comm_type)
            if not pre_process:  # the last stage's copy of the word embedding
                copy = self.mtp.word_embeddings.weight
                copy.init_key, copy.shared_embedding, copy.pipeline_duplicate = \
                    WORD_EMBEDDINGS, True, True
        if pre_process and not post_process and (self.share_embeddings_and_output_weights or
                                                 mtp_depths(config)):
            self.embedding.word_embeddings.weight.shared_embedding = True
        assign_dropout_sites(self)

    # ------------------------------------------------------------------ weights
    def init_weights(self, seed: int) -> None:
        """Layout-independent init: the dense weights depend only on `seed` (see layers.sharding)."""
        initialize_parameters(self, seed, self.config.init_method_std, self.config.num_layers)

    def sharding_units(self) -> list[nn.Module]:
        """Submodules whose parameters ZeRO-3 gathers together, in forward order: the embedding
        (unless its weight is also this chunk's output layer's, or multi-token prediction
        reads it after its forward), each transformer layer, the MTP depths, and the output
        layer when it has its own weight. The rest (final norm, a tied embedding) is the
        chunk's root unit (data_parallel/fsdp.py)."""
        units = []
        tied_here = self.share_embeddings_and_output_weights and self.pre_process \
            and self.post_process
        # MTP looks tokens up in this chunk's embedding after its forward: keep it in the root
        if self.pre_process and not tied_here and not (self.post_process and self.mtp is not None):
            units.append(self.embedding)
        units += list(self.decoder.layers.values())
        if self.post_process and self.mtp is not None:
            units.append(self.mtp)
        if self.post_process and self.output_layer.weight is not None:
            units.append(self.output_layer)
        return units

    def output_weight(self) -> torch.Tensor:
        if self.post_process and self.output_layer.weight is not None:
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor | None = None, *,
                position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None,
                hidden_states: torch.Tensor | None = None,
                kv_cache=None, position_offset: int = 0,
                attention_mask: torch.Tensor | None = None, label_smoothing: float = 0.0,
                output_positions: torch.Tensor | None = None,
                mtp_tokens: torch.Tensor | None = None,
                mtp_labels: torch.Tensor | None = None) -> torch.Tensor:
        """Run this stage.

        Args:
            input_ids: `[b, s]` token ids (first stage; also used for the length elsewhere).
            position_ids: `[b, s]` position of every token (learned positions and RoPE;
                default position_offset..position_offset+s-1 for every row).
            labels: `[b, s]` next-token targets (-100 = ignore) on the last stage.
            hidden_states: `[s, b, h]` (`[s/tp, b, h]` with SP) from the previous stage.
            kv_cache: inference cache (see layers.attention.SelfAttention).
            position_offset: position of the first token (decoding with a cache).
            attention_mask: `[b, 1, s, s_kv]` bool, True = may attend (default causal); or
                a dict of one mask per layer kind (layers/attention.py SelfAttention). With
                sliding-window layers and no cache, the dict is made here from it.
            output_positions: `[b]` int64 (last stage, no labels): only token
                output_positions[i] of row i goes through the output layer (inference: the
                logits that are sampled; HF's `logits_to_keep`). Not with sequence parallel.
            mtp_tokens, mtp_labels: `[b, D, s]` (last stage, training with multi-token
                prediction): `input_ids` and `labels` shifted left by k for depth k on the
                whole sequence (models/mtp.py `mtp_shifted`); made from `input_ids` and
                `labels` when not given (not under context parallelism).
            Under context parallelism every `[b, s]` argument and result holds this CP rank's
            part `[b, s/cp]` of each sequence (hidden states `[s/cp, b, h]`); position_ids
            default to those tokens' global positions.
        Returns:
            last stage with labels: per-token loss `[b, s]` float32 (nats);
            last stage without labels: vocab-parallel logits `[b, s, v_padded/tp]`
                (`[b, 1, v_padded/tp]` with output_positions);
            other stages: hidden states `[s, b, h]` (or `[s/tp, b, h]`).
        """
        dropout_positions = None
        if self.cp_group is not None:  # this CP rank's tokens: their global positions
            if input_ids is None:
                raise ValueError("under context parallelism every stage needs input_ids "
                                 "(this rank's part of the tokens: its positions)")
            dropout_positions = context_parallel_positions(input_ids.shape[1], self.cp_group)
            if position_ids is None:
                position_ids = dropout_positions.to(input_ids.device)[None].expand(
                    input_ids.shape[0], -1)
        if self.pre_process:
            x = self.embedding(input_ids, position_ids, dropout_positions=dropout_positions)
        else:
            if hidden_states is None:
                raise ValueError("a stage without the embedding needs hidden_states")
            x = hidden_states
        rotary = None
        if self.rotary is not None:
            seq_len = x.shape[0] * (get_tensor_model_parallel_world_size()
                                    if self.sequence_parallel else 1)
            rotary = self.rotary(seq_len, position_offset, device=x.device,
                                 position_ids=position_ids)
            if self.rotary_local is not None:
                rotary = rotary + self.rotary_local(seq_len, position_offset, device=x.device,
                                                    position_ids=position_ids)
        if self.config.window_size is not None and kv_cache is None and \
                self.cp_group is None and \
                not isinstance(attention_mask, dict):  # one sliding mask for all layers
            seq_len = x.shape[0] * (get_tensor_model_parallel_world_size()
                                    if self.sequence_parallel else 1)
            attention_mask = window_attention_masks(attention_mask, seq_len,
                                                    self.config.window_size, x.dtype, x.device)
        x = self.decoder(x, rotary=rotary, kv_cache=kv_cache, attention_mask=attention_mask)
        if not self.post_process:
            return x
        if self.mtp is not None and labels is not None and self.training:
            return self._loss_with_mtp(x, input_ids, labels, rotary, attention_mask,
                                       label_smoothing, mtp_tokens, mtp_labels)
        if output_positions is not None:
            if self.sequence_parallel or labels is not None:
                raise ValueError("output_positions is for inference: no labels, no sequence "
                                 "parallelism")
            x = x[output_positions, torch.arange(x.shape[1], device=x.device)][None]  # [1, b, h]
        logits = self.output_layer(x, weight=self.output_weight())  # [s, b, v/tp]
        cap = self.config.final_logit_softcapping
        if cap is not None:  # Gemma 2: cap * tanh(logits / cap), elementwise on the shard
            logits = torch.tanh(logits / cap) * cap
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        loss = vocab_parallel_cross_entropy(logits, labels.t(), vocab_size=self.config.vocab_size,
                                            label_smoothing=label_smoothing)
        return loss.t()

    def _loss_with_mtp(self, x, input_ids, labels, rotary, attention_mask, label_smoothing,
                       mtp_tokens, mtp_labels):
        """The per-token main loss `[b, s]`; the depths' per-token losses `[D, b, s]` stay
        in `self.mtp.last_losses` for the schedule's MTP term (models/mtp.py `objective`).
        The depths' hidden states go through the output layer with the main ones in one
        call, stacked along the batch (`[s, (1+D) b, h]`, so sequence-parallel shards stay
        whole rows)."""
        d = mtp_depths(self.config)
        if mtp_tokens is None or mtp_labels is None:
            if self.cp_group is not None:
                raise ValueError("multi-token prediction under context parallelism needs "
                                 "mtp_tokens and mtp_labels shifted on the whole sequence "
                                 "before the split (training/batches.py makes them)")
            mtp_tokens, mtp_labels = mtp_shifted(input_ids, d, 0), mtp_shifted(labels, d, -100)
        embed = self.embedding.word_embeddings if self.pre_process else None
        depths = self.mtp(x, mtp_tokens, embed, rotary=rotary, attention_mask=attention_mask)
        logits = self.output_layer(torch.cat([x] + depths, dim=1), weight=self.output_weight())
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        b = labels.shape[0]
        targets = torch.cat([labels, *mtp_labels.unbind(1)])  # [(1+D)b, s]
        loss = vocab_parallel_cross_entropy(logits, targets.t(),
                                            vocab_size=self.config.vocab_size,
                                            label_smoothing=label_smoothing).t()  # [(1+D)b, s]
        self.mtp.last_losses = loss[b:].reshape(d, b, -1)
        return loss[:b]
