"""Model configs and families: GPTModel (GPT-2 and Llama styles) and T5Model."""
from .config import ConfigError, ModelConfig  # noqa: F401
from .gpt import GPTModel  # noqa: F401
from .t5 import T5Model  # noqa: F401


def model_class(config: ModelConfig):
    """The model family of `config`: T5Model for `model_type: t5`, else GPTModel."""
    return T5Model if config.is_encoder_decoder else GPTModel
