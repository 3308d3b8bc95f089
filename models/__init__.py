"""Model configs and families: GPTModel (GPT-2 and Llama styles)."""
from .config import ConfigError, ModelConfig  # noqa: F401
from .gpt import GPTModel  # noqa: F401
