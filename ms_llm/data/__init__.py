"""Data pipeline: tokenizers, the embedded offline default corpus, packed datasets and loaders."""
from .dataset import BatchIterator, PretrainDataset, read_documents, token_dtype, tokenize_corpus
from .embedded import default_cache_root, ensure_default_corpus
from .tokenizer import HFTokenizer, SentencePieceTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "BatchIterator",
    "HFTokenizer",
    "PretrainDataset",
    "SentencePieceTokenizer",
    "Tokenizer",
    "default_cache_root",
    "ensure_default_corpus",
    "load_tokenizer",
    "read_documents",
    "token_dtype",
    "tokenize_corpus",
]
