"""Corpus + tokenizer -> token stream -> sharded loader, and the vocab size the model needs."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from ms_llm.config import ConfigError, RunConfig
from ms_llm.data import (BatchIterator, PretrainDataset, Tokenizer, ensure_default_corpus,
                         load_tokenizer, tokenize_corpus)
from ms_llm.models.config import TransformerConfig

log = logging.getLogger("ms_llm.train")


@dataclass
class TrainData:
    tokenizer: Tokenizer
    loader: BatchIterator
    num_tokens: int
    model_config: TransformerConfig


def padded_vocab(vocab_size: int, divisible_by: int) -> int:
    """Megatron's ``--make-vocab-size-divisible-by`` rounding (tp = 1)."""
    return -(-vocab_size // divisible_by) * divisible_by


def build_data(cfg: RunConfig, dp_rank: int = 0, dp_size: int = 1) -> TrainData:
    d = cfg.data
    corpus, tok_path = d.corpus, d.tokenizer
    if corpus == "embedded" or tok_path == "embedded":
        emb_corpus, emb_tok = ensure_default_corpus(d.cache_dir, d.embedded_vocab_size)
        corpus = emb_corpus if corpus == "embedded" else corpus
        tok_path = emb_tok if tok_path == "embedded" else tok_path
    try:
        tokenizer = load_tokenizer(tok_path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.tokenizer: {e}") from None
    try:
        tokens = tokenize_corpus(corpus, tokenizer, text_key=d.json_key)
    except FileNotFoundError as e:
        raise ConfigError(f"data.corpus: {e}") from None
    model_cfg = cfg.model
    if cfg.checkpoint.load is None and "padded_vocab_size" not in cfg.model_overrides:
        model_cfg = model_cfg.replace(
            padded_vocab_size=padded_vocab(tokenizer.vocab_size, d.make_vocab_size_divisible_by))
    elif model_cfg.padded_vocab_size < tokenizer.vocab_size and cfg.checkpoint.load is None:
        raise ConfigError(f"model.padded_vocab_size ({model_cfg.padded_vocab_size}) is smaller "
                          f"than the tokenizer's vocabulary ({tokenizer.vocab_size})")
    dataset = PretrainDataset(tokens, d.seq_length)
    loader = BatchIterator(dataset, cfg.training.micro_batch_size, cfg.training.seed,
                           dp_rank=dp_rank, dp_size=dp_size)
    return TrainData(tokenizer, loader, int(len(tokens)), model_cfg)
