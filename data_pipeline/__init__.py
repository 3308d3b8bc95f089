"""Data pipeline: tokenizers, memory-mapped indexed datasets, GPT samples/blends, demo corpus."""
from data_pipeline.default_corpus import ensure_default_corpus
from data_pipeline.gpt_dataset import (BlendedDataset, GPTDataset, batch_digest,
                                       build_train_valid_test_datasets)
from data_pipeline.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from models.tokenizer import Tokenizer, build_tokenizer, train_sentencepiece

__all__ = [
    "Tokenizer", "build_tokenizer", "train_sentencepiece",
    "IndexedDatasetBuilder", "IndexedDataset",
    "GPTDataset", "BlendedDataset", "batch_digest", "build_train_valid_test_datasets",
    "ensure_default_corpus",
]
