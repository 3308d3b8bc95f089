"""T5Model: the encoder-decoder transformer of Raffel et al. 2020 ("T5"), from the same
parallel layers as GPTModel.

Encoder: embedding -> bidirectional pre-norm layers -> final RMS norm. Decoder: embedding ->
layers of causal self-attention, cross-attention to the encoder output and MLP -> final RMS
norm -> output layer. T5's choices, all by `ModelConfig`: RMS norm without mean subtraction
or bias (`normalization: RMSNorm`), no linear biases, no 1/sqrt(d) score scaling, a learned
relative position bias (`layers.attention.RelativePositionBias`: one table per stack, read by
every layer of the stack, bidirectional buckets in the encoder and causal ones in the
decoder, none in cross-attention), ReLU (v1.0) or gated-GeLU (v1.1) MLPs, and either the
embedding tied to the output layer with the decoder output rescaled by `h**-0.5` (v1.0) or
an untied output layer without rescaling (v1.1). Encoder and decoder share one embedding.

Pipeline stages: a stage holds a run of encoder layers or of decoder layers
(`encoder_layer_numbers` / `decoder_layer_numbers`); the embedding sits on every stage that
holds the first layer of a stack, each stack's final norm and position-bias table on the
stages that need them, the output layer on the stage with the last decoder layer.
"""
from __future__ import annotations

import torch
from torch import nn

from layers import (
    ColumnParallelLinear,
    LanguageModelEmbedding,
    RelativePositionBias,
    TransformerBlock,
    initialize_parameters,
    vocab_parallel_cross_entropy,
)
from layers.dropout import add_dropout_site, assign_dropout_sites, hidden_dropout, sub_site
from parallel_state import get_tensor_model_parallel_world_size

from .config import ConfigError, ModelConfig
from .gpt import WORD_EMBEDDINGS


def shift_right(labels: torch.Tensor, start_token_id: int = 0) -> torch.Tensor:
    """Decoder inputs from targets `[b, s]`: `[start, labels[:, :-1]]`, with ignored targets
    (-100) read as `start_token_id` (T5 starts the decoder with the pad id, 0)."""
    out = labels.new_full(labels.shape, start_token_id)
    out[:, 1:] = labels[:, :-1]
    return out.masked_fill(out == -100, start_token_id)


class T5Model(nn.Module):
    """Encoder-decoder language model, sharded over TP (and over PP by stack and layer).

    Args:
        config: `model_type: t5` shape (validated for this TP size).
        encoder_layer_numbers / decoder_layer_numbers: global 0-based layers of each stack
            held here (default: all of both).
        sequence_parallel: norms/dropout on sequence shards `[s/tp, b, h]` (both the encoder
            and the decoder length must be divisible by tp).
    Raises `ConfigError` for a non-T5 config.
    """

    def __init__(self, config: ModelConfig, *, encoder_layer_numbers: list[int] | None = None,
                 decoder_layer_numbers: list[int] | None = None,
                 sequence_parallel: bool = False):
        super().__init__()
        if not config.is_encoder_decoder:
            raise ConfigError(f"T5Model needs --model-type t5, got {config.model_type!r}")
        tp = get_tensor_model_parallel_world_size()
        config.validate(tp)
        self.config = config
        self.sequence_parallel = sp = sequence_parallel and tp > 1
        self.padded_vocab_size = config.padded_vocab_size(tp)
        self.share_embeddings_and_output_weights = not config.untie_embeddings_and_output_weights
        enc = list(range(config.encoder_num_layers)) if encoder_layer_numbers is None \
            else list(encoder_layer_numbers)
        dec = list(range(config.decoder_num_layers)) if decoder_layer_numbers is None \
            else list(decoder_layer_numbers)
        self.encoder_layer_numbers, self.decoder_layer_numbers = enc, dec
        self.add_encoder, self.add_decoder = bool(enc), bool(dec)
        # pre_process: this stage embeds tokens (it holds the first layer of a stack)
        self.pre_process = (0 in enc) or (0 in dec)
        self.post_process = (config.decoder_num_layers - 1) in dec
        self.encoder_pre_process, self.decoder_pre_process = 0 in enc, 0 in dec
        self.encoder_post_process = (config.encoder_num_layers - 1) in enc
        heads, buckets = config.num_attention_heads, config.relative_attention_num_buckets
        distance = config.relative_attention_max_distance

        if self.pre_process:
            self.embedding = LanguageModelEmbedding(config, self.padded_vocab_size,
                                                    sequence_parallel=sp)
        if self.add_encoder:
            self.encoder_position_bias = RelativePositionBias(buckets, distance, heads, True)
            self.encoder = TransformerBlock(config, enc, post_layer_norm=self.encoder_post_process,
                                            sequence_parallel=sp, causal=False, softmax_scale=1.0)
        if self.add_decoder:
            self.decoder_position_bias = RelativePositionBias(buckets, distance, heads, False)
            self.decoder = TransformerBlock(config, dec, post_layer_norm=self.post_process,
                                            sequence_parallel=sp, cross_attention=True,
                                            softmax_scale=1.0)
        if self.post_process:
            tied_here = self.share_embeddings_and_output_weights and self.pre_process
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, self.padded_vocab_size, bias=False, sequence_parallel=sp,
                skip_weight=tied_here, full_rows=config.vocab_size)
            if self.share_embeddings_and_output_weights and not self.pre_process:
                self.output_layer.weight.init_key = WORD_EMBEDDINGS
                self.output_layer.weight.shared_embedding = True
        self._tag_pipeline_copies()
        add_dropout_site(self)  # the encoder's and the decoder's output dropouts (sub-sites 0, 1)
        assign_dropout_sites(self)

    def _tag_pipeline_copies(self) -> None:
        """Mark the parameters other pipeline stages also hold, so that their gradients are
        summed over those stages and the global norm counts each once: the word embedding
        (encoder input, decoder input, tied output layer: Megatron's embedding group) and
        each stack's position-bias table (on every stage of the stack: `stage_group`).
        `pipeline_duplicate` marks the copies the norm skips."""
        c = self.config
        if self.pre_process:
            word = self.embedding.word_embeddings.weight
            both_inputs = self.encoder_pre_process and self.decoder_pre_process
            tied_output_elsewhere = self.share_embeddings_and_output_weights and \
                not self.post_process
            if not both_inputs or tied_output_elsewhere:
                word.shared_embedding = True
            if not self.encoder_pre_process:  # the first decoder stage: stage 0 counts it
                word.pipeline_duplicate = True
        if self.post_process and getattr(self.output_layer.weight, "shared_embedding", False):
            self.output_layer.weight.pipeline_duplicate = True
        for stack, layers, total in (("encoder", self.encoder_layer_numbers, c.encoder_num_layers),
                                     ("decoder", self.decoder_layer_numbers, c.decoder_num_layers)):
            if layers and len(layers) < total:  # the stack spans several stages
                table = getattr(self, f"{stack}_position_bias").weight
                table.stage_group = f"{stack}_position_bias"
                table.pipeline_duplicate = 0 not in layers

    # ------------------------------------------------------------------ weights
    def init_weights(self, seed: int) -> None:
        """Layout-independent init: the dense weights depend only on `seed` (layers.sharding)."""
        initialize_parameters(self, seed, self.config.init_method_std, self.config.num_layers)

    def transformer_blocks(self) -> list[TransformerBlock]:
        """The encoder and/or decoder blocks held here (recompute and memory accounting)."""
        return [b for b in (getattr(self, "encoder", None), getattr(self, "decoder", None))
                if b is not None]

    def sharding_units(self) -> list[nn.Module]:
        """ZeRO-3 gather units in forward order (see GPTModel.sharding_units)."""
        tied_here = self.share_embeddings_and_output_weights and self.pre_process \
            and self.post_process
        units = [self.embedding] if self.pre_process and not tied_here else []
        for block in self.transformer_blocks():
            units += list(block.layers.values())
        if self.post_process and self.output_layer.weight is not None:
            units.append(self.output_layer)
        return units

    def output_weight(self) -> torch.Tensor:
        if self.post_process and self.output_layer.weight is not None:
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    # ------------------------------------------------------------------ forward
    def _full_length(self, x: torch.Tensor) -> int:
        return x.shape[0] * (get_tensor_model_parallel_world_size() if self.sequence_parallel
                             else 1)

    def encode(self, input_ids: torch.Tensor | None = None,
               hidden_states: torch.Tensor | None = None,
               encoder_attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Encoder layers held here: `input_ids [b, se]` (first encoder stage) or
        `hidden_states [se, b, h]` -> `[se, b, h]` (`[se/tp, b, h]` under SP; after the final
        norm on the last encoder stage). `encoder_attention_mask [b, se]` bool, True = real
        token (default: all real)."""
        x = self.embedding(input_ids, dropout_sub_site=0) if self.encoder_pre_process \
            else hidden_states
        if x is None:
            raise ValueError("an encoder stage without the embedding needs hidden_states")
        s = self._full_length(x)
        bias = self.encoder_position_bias(s, s, device=x.device)
        mask = None if encoder_attention_mask is None else encoder_attention_mask[:, None, None, :]
        x = self.encoder(x, attention_mask=mask, attention_bias=bias)
        if self.encoder_post_process:  # T5 drops out the encoder output too
            x = hidden_dropout(x, self.config.hidden_dropout, self.training,
                               sub_site(self.dropout_site, 0), self.sequence_parallel)
        return x

    def decode(self, decoder_input_ids: torch.Tensor | None, encoder_output: torch.Tensor, *,
               hidden_states: torch.Tensor | None = None, labels: torch.Tensor | None = None,
               encoder_attention_mask: torch.Tensor | None = None, kv_cache=None,
               position_offset: int = 0, position_ids: torch.Tensor | None = None,
               attention_mask: torch.Tensor | None = None, label_smoothing: float = 0.0,
               output_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Decoder layers held here.

        Args:
            decoder_input_ids: `[b, sd]` (first decoder stage; `shift_right(labels)` in
                training).
            encoder_output: `[se, b, h]` (`[se/tp, b, h]` under SP), the encoder's output
                (None when decoding from a cache that holds the cross-attention keys/values).
            hidden_states: `[sd, b, h]` from the previous decoder stage.
            labels: `[b, sd]` targets (-100 = ignore), on the last stage.
            encoder_attention_mask: `[b, se]` bool, True = real encoder token.
            kv_cache: inference cache (self-attention `update`, cross-attention `cross`).
            position_offset: decoder position of the first token (decoding with a cache).
            position_ids: `[b, sd]` decoder position of every token (batched decoding, rows
                at different positions; replaces position_offset).
            attention_mask: `[b, 1, sd, s_kv]` bool self-attention mask (default causal).
            output_positions: `[b]` (last stage, no labels): the one token per row whose
                logits are returned.
        Returns: per-token loss `[b, sd]` float32 (last stage with labels), vocab-parallel
            logits `[b, sd or 1, v_padded/tp]` (last stage), else hidden `[sd, b, h]`.
        """
        x = self.embedding(decoder_input_ids, dropout_sub_site=1) if self.decoder_pre_process \
            else hidden_states
        if x is None:
            raise ValueError("a decoder stage without the embedding needs hidden_states")
        s = self._full_length(x)
        if position_ids is not None:
            keys = attention_mask.shape[-1] if attention_mask is not None else \
                int(position_ids.max()) + 1
            bias = self.decoder_position_bias(s, keys, device=x.device,
                                              query_positions=position_ids)
        else:
            bias = self.decoder_position_bias(s, position_offset + s, device=x.device)
        mask = None if encoder_attention_mask is None else encoder_attention_mask[:, None, None, :]
        x = self.decoder(x, kv_cache=kv_cache, attention_bias=bias, attention_mask=attention_mask,
                         encoder_output=encoder_output, cross_attention_mask=mask)
        if not self.post_process:
            return x
        x = hidden_dropout(x, self.config.hidden_dropout, self.training,
                           sub_site(self.dropout_site, 1), self.sequence_parallel)
        if output_positions is not None:
            if self.sequence_parallel or labels is not None:
                raise ValueError("output_positions is for inference: no labels, no sequence "
                                 "parallelism")
            x = x[output_positions, torch.arange(x.shape[1], device=x.device)][None]
        if self.share_embeddings_and_output_weights:  # T5 v1.0 (Mesh TensorFlow) rescaling
            x = x * self.config.hidden_size ** -0.5
        logits = self.output_layer(x, weight=self.output_weight())  # [s, b, v/tp]
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        loss = vocab_parallel_cross_entropy(logits, labels.t(), vocab_size=self.config.vocab_size,
                                            label_smoothing=label_smoothing)
        return loss.t()

    def forward(self, input_ids: torch.Tensor | None = None, *,
                decoder_input_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None,
                hidden_states=None,
                encoder_attention_mask: torch.Tensor | None = None,
                label_smoothing: float = 0.0, **unused) -> torch.Tensor | tuple:
        """One training/eval step of this stage.

        `input_ids [b, se]` encoder tokens, `decoder_input_ids [b, sd]` (default
        `shift_right(labels)`), `labels [b, sd]`. `hidden_states` is what the previous stage
        sent: the encoder hidden `[se, b, h]` on an encoder stage; `(encoder_output,)` on the
        first decoder stage; `(decoder hidden, encoder_output)` on later decoder stages.
        Returns the loss `[b, sd]` (last stage with labels), the logits (last stage), the
        encoder output (an encoder stage), or `(decoder hidden, encoder_output)` (a decoder
        stage before the last): the encoder output travels beside the decoder hidden states
        so every decoder stage reads it, and its gradient comes back the same way.
        """
        if decoder_input_ids is None and labels is not None:
            decoder_input_ids = shift_right(labels)
        if isinstance(hidden_states, torch.Tensor):
            hidden_states = (hidden_states,)
        if self.add_encoder:
            enc = self.encode(input_ids, hidden_states[0] if hidden_states else None,
                              encoder_attention_mask)
            if not self.add_decoder:
                return enc
            hidden, encoder_output = None, enc
        elif self.decoder_pre_process:
            hidden, encoder_output = None, hidden_states[0]
        else:
            hidden, encoder_output = hidden_states
        out = self.decode(decoder_input_ids, encoder_output, hidden_states=hidden, labels=labels,
                          encoder_attention_mask=encoder_attention_mask,
                          label_smoothing=label_smoothing)
        return out if self.post_process else (out, encoder_output)
