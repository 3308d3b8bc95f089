"""Parallel building blocks: column/row linear, vocab embedding, vocab-parallel cross entropy,
norms, attention, MLP, mixture-of-experts MLP (moe/), transformer layer and block."""
from .attention import (  # noqa: F401
    CrossAttention,
    RelativePositionBias,
    RotaryEmbedding,
    SelfAttention,
    apply_rotary_pos_emb,
    relative_position_bucket,
)
from .cross_entropy import vocab_parallel_cross_entropy  # noqa: F401
from .embedding import LanguageModelEmbedding, VocabParallelEmbedding  # noqa: F401
from .linear import ColumnParallelLinear, RowParallelLinear  # noqa: F401
from .mlp import MLP  # noqa: F401
from .moe import MoELayer  # noqa: F401
from .norm import LayerNorm, RMSNorm, build_norm  # noqa: F401
from .sharding import (  # noqa: F401
    full_shape,
    initial_value,
    initialize_parameters,
    parameters_on_meta,
    set_tensor_parallel_attributes,
    shard_tensor,
    unshard_tensors,
)
from .transformer import (  # noqa: F401
    TransformerBlock,
    TransformerLayer,
    compile_transformer_block,
    compile_transformer_layers,
)
