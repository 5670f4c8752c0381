"""Data pipeline: tokenizers, the embedded offline default corpus, Megatron indexed datasets,
``ms-llm preprocess``, GPT pretraining / SFT / pairwise datasets and the resumable loader."""
from .dataset import BatchIterator, PretrainDataset, read_documents, token_dtype, tokenize_corpus
from .embedded import default_cache_root, ensure_default_corpus
from .gpt_dataset import (BlendedDataset, GPTDataset, GPTDatasetConfig, build_pretrain_dataset,
                          build_pretrain_datasets)
from .indexed import IndexedDataset, IndexedDatasetBuilder
from .sft import PairwiseDataset, SFTDataset, open_sft_dataset
from .tokenizer import HFTokenizer, SentencePieceTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "BatchIterator",
    "BlendedDataset",
    "GPTDataset",
    "GPTDatasetConfig",
    "HFTokenizer",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "PairwiseDataset",
    "PretrainDataset",
    "SFTDataset",
    "SentencePieceTokenizer",
    "Tokenizer",
    "build_pretrain_dataset",
    "build_pretrain_datasets",
    "default_cache_root",
    "ensure_default_corpus",
    "load_tokenizer",
    "open_sft_dataset",
    "read_documents",
    "token_dtype",
    "tokenize_corpus",
]
