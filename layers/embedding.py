"""Vocab-parallel word embedding and the language-model embedding block.

The vocabulary is padded to a multiple of `make_vocab_size_divisible_by * tp` (Megatron) and
split into contiguous row ranges; each rank looks up the tokens it owns, zeroes the rest, and
the partial embeddings are summed over TP (Shoeybi et al. 2019, sec. 3, "input embedding").
Padding rows are zero and are masked out of the softmax, so the loss is the same at any TP.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

from .dropout import add_dropout_site, hidden_dropout, sub_site
from .quantized import embedding_rows
from .sharding import set_tensor_parallel_attributes


class VocabParallelEmbedding(nn.Module):
    """Embedding with rows split over TP ranks.

    `forward(ids [s, b])` -> `[s, b, h]` summed over TP, or `[s/tp, b, h]` reduce-scattered when
    `reduce_scatter_embeddings` (sequence parallelism). `num_embeddings` is the padded vocab;
    `vocab_size` the real one (rows at and beyond it stay zero).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, vocab_size: int | None = None,
                 reduce_scatter_embeddings: bool = False,
                 params_dtype: torch.dtype = torch.float32):
        super().__init__()
        tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        if num_embeddings % tp:
            raise ValueError(f"padded vocab {num_embeddings} is not divisible by "
                             f"tensor-model-parallel-size {tp}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_size = vocab_size or num_embeddings
        per_rank = num_embeddings // tp
        self.vocab_start_index, self.vocab_end_index = rank * per_rank, (rank + 1) * per_rank
        self.reduce_scatter_embeddings = reduce_scatter_embeddings and tp > 1
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim, dtype=params_dtype))
        self.float_dtype = params_dtype
        set_tensor_parallel_attributes(self.weight, partition_dim=0, init="normal",
                                       full_rows=self.vocab_size)

    def dtype(self) -> torch.dtype:
        """The float dtype of the rows it returns: its weight's, or for a low-bit table
        (layers/quantized.py) the model's (`float_dtype`, set by `Module.to`; float32)."""
        return getattr(self.weight, "dtype", None) or self.float_dtype

    def _apply(self, fn, recurse=True):
        self.float_dtype = fn(torch.empty((), dtype=self.float_dtype)).dtype
        return super()._apply(fn, recurse)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if get_tensor_model_parallel_world_size() > 1:
            outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
            local = (ids - self.vocab_start_index).masked_fill(outside, 0)
            out = embedding_rows(local, self.weight, self.dtype()).masked_fill(
                outside.unsqueeze(-1), 0.0)
        else:
            out = embedding_rows(ids, self.weight, self.dtype())
        if self.reduce_scatter_embeddings:
            return reduce_scatter_to_sequence_parallel_region(out)
        return reduce_from_tensor_model_parallel_region(out)


class LanguageModelEmbedding(nn.Module):
    """Word (+ learned absolute position) embeddings and embedding dropout.

    `forward(input_ids [b, s], position_ids [b, s] | None)` -> `[s, b, h]`, or `[s/tp, b, h]`
    with sequence parallelism (dropout then runs on the shard with the TP RNG stream).
    """

    def __init__(self, config, padded_vocab_size: int, sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel and get_tensor_model_parallel_world_size() > 1
        self.word_embeddings = VocabParallelEmbedding(
            padded_vocab_size, config.hidden_size, vocab_size=config.vocab_size,
            reduce_scatter_embeddings=self.sequence_parallel)
        self.learned_positions = config.position_embedding_type == "learned_absolute"
        if self.learned_positions:
            self.position_embeddings = nn.Embedding(config.max_position_embeddings,
                                                    config.hidden_size)
            set_tensor_parallel_attributes(self.position_embeddings.weight, partition_dim=None,
                                           init="normal",
                                           sequence_parallel=self.sequence_parallel)
        self.hidden_dropout = config.hidden_dropout
        # Gemma: x sqrt(hidden), rounded to float32 then to the embedding's dtype (as HF's
        # Gemma3TextScaledWordEmbedding), so bf16 models scale by bf16(sqrt(h)) as it does
        self.embedding_scale = math.sqrt(config.hidden_size) \
            if getattr(config, "apply_embedding_scaling", False) else None
        add_dropout_site(self)  # set from the module's name (layers/dropout.py)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                dropout_sub_site: int = 0,
                dropout_positions: torch.Tensor | None = None) -> torch.Tensor:
        """`dropout_sub_site`: which of a model's embedding dropouts this is (T5 embeds the
        encoder and the decoder input with one module). `dropout_positions` `[s]`: the global
        sequence position of each token, which keys the dropout mask (context parallelism:
        a rank's part of the sequence; default 0..s-1; see layers.dropout.hidden_dropout)."""
        x = self.word_embeddings(input_ids.t())  # [s, b, h] or [s/tp, b, h]
        if self.embedding_scale is not None:
            x = x * torch.tensor(self.embedding_scale, dtype=torch.float32).to(x.dtype)
        if self.learned_positions:
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
                pos = self.position_embeddings(position_ids).unsqueeze(1)  # [s, 1, h]
            else:
                pos = self.position_embeddings(position_ids.t())  # [s, b, h]
            if self.sequence_parallel:
                tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
                pos = pos.chunk(tp, dim=0)[rank]
            x = x + pos
        return hidden_dropout(x, self.hidden_dropout, self.training,
                              sub_site(self.dropout_site, dropout_sub_site),
                              self.sequence_parallel, positions=dropout_positions)
