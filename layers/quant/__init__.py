"""Low-bit linear weights: int8 per channel, int4 in groups, and GGUF's block formats (q8_0,
q4_0, q4_1, q4_k, q6_k), kept packed and multiplied without a float copy of the weight
(formats.py: the storage and exact de-quantization; weight.py: `QuantizedWeight`)."""
from .formats import (FORMATS, GGUF_FORMATS, INT4_GROUP_SIZES, OWN_FORMATS,  # noqa: F401
                      storage_bytes)
from .weight import QuantizedWeight  # noqa: F401
