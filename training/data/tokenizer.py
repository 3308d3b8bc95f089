"""Re-export of `models.tokenizer` (tokenizers moved below training and inference, which both
use them); kept so existing imports keep working."""
from models.tokenizer import (  # noqa: F401
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    Tokenizer,
    build_tokenizer,
    encode_documents,
    train_sentencepiece,
)
