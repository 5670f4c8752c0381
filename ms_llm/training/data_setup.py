"""Corpus + tokenizer -> token stream -> sharded loader, and the vocab size the model needs."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

from ms_llm.config import ConfigError, RunConfig
from ms_llm.data import (BatchIterator, PretrainDataset, Tokenizer, ensure_default_corpus,
                         load_tokenizer, tokenize_corpus)
from ms_llm.data.tokenizer import padded_vocab
from ms_llm.models.config import TransformerConfig

log = logging.getLogger("ms_llm.train")


@dataclass
class TrainData:
    tokenizer: Tokenizer
    loader: BatchIterator
    num_tokens: int
    model_config: TransformerConfig
    valid: Optional[object] = None      # the data.split validation part (when evaluating)


def build_data(cfg: RunConfig, dp_rank: int = 0, dp_size: int = 1) -> TrainData:
    """The tokenizer, the sharded batches, and the model config they need: with
    ``checkpoint.load`` the folder's architecture (``load_config`` adopted it before the rules
    ran), otherwise the config's with the tokenizer's padded vocabulary."""
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
    tokens = None
    if d.data_path:
        dataset, valid = _indexed_dataset(cfg, tokenizer)
    else:
        try:
            tokens = tokenize_corpus(corpus, tokenizer, text_key=d.json_key)
        except FileNotFoundError as e:
            raise ConfigError(f"data.corpus: {e}") from None
        dataset, valid = _split(cfg, PretrainDataset(tokens, d.seq_length))
    if cfg.training.eval_interval is None:
        valid = None
    elif valid is None:
        raise ConfigError(f"{cfg.source_of('training.eval_interval', 'data.split')}: "
                          f"training.eval_interval needs validation samples, but data.split "
                          f"{d.split!r} gives none")
    model_cfg = cfg.model
    if cfg.checkpoint.load:
        _check_loaded_vocab(cfg, tokenizer, tok_path)
    elif "padded_vocab_size" not in cfg.model_overrides:
        model_cfg = model_cfg.replace(
            padded_vocab_size=padded_vocab(tokenizer.vocab_size, d.make_vocab_size_divisible_by))
    elif model_cfg.padded_vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model.padded_vocab_size ({model_cfg.padded_vocab_size}) is smaller "
                          f"than the tokenizer's vocabulary ({tokenizer.vocab_size})")
    # Megatron's pretraining samples are already shuffled by the dataset's own indices, and
    # MindSpeed's instruction-data order (data.padded_samples / data.shuffle) is built up front.
    shuffle = not (d.data_path and (d.dataset_type == "pretrain" or _mindspeed_order(cfg)))
    loader = BatchIterator(dataset, cfg.training.micro_batch_size, cfg.training.seed,
                           dp_rank=dp_rank, dp_size=dp_size, shuffle=shuffle)
    n_tokens = int(len(tokens)) if tokens is not None else len(dataset) * d.seq_length
    return TrainData(tokenizer, loader, n_tokens, model_cfg, valid)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def _check_loaded_vocab(cfg: RunConfig, tokenizer: Tokenizer, tok_path: str) -> None:
    """Every token id must have a row in the loaded embedding (an id past the last row fails
    inside a kernel at step 1). Also says when the folder ships a tokenizer the run does not
    use: its weights were trained on that one's ids."""
    folder, rows = cfg.checkpoint.load, cfg.model.padded_vocab_size
    if tokenizer.vocab_size > rows:
        raise ConfigError(f"{cfg.source_of('data.tokenizer', 'checkpoint.load')}: data.tokenizer "
                          f"{tok_path} has {tokenizer.vocab_size} tokens but checkpoint.load "
                          f"{folder} has {rows} embedding rows (padded_vocab_size); use the "
                          f"tokenizer the folder was trained with")
    own = [n for n in _TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n))]
    if own and cfg.data.tokenizer == "embedded":
        log.warning("data.tokenizer is the embedded tokenizer but checkpoint.load %s has its "
                    "own (%s); set data.tokenizer: %s to train on the ids its weights know",
                    folder, own[0], folder)


def _split(cfg: RunConfig, dataset):
    """(train, validation or None) of a sample-level dataset by ``data.split``."""
    from ms_llm.data.splits import split_samples
    try:
        return split_samples(dataset, cfg.data.split)
    except ValueError as e:
        raise ConfigError(f"{cfg.source_of('data.split')}: data.split: {e}") from None


def valid_samples(cfg: RunConfig) -> int:
    """Megatron's validation sample count: ``eval_iters`` global batches per evaluation, one
    evaluation every ``eval_interval`` steps plus the final one."""
    t = cfg.training
    if t.eval_interval is None:
        return 0
    return t.eval_iters * t.global_batch_size * (t.max_steps // t.eval_interval + 1)


def _mindspeed_order(cfg: RunConfig) -> bool:
    """Instruction / pairwise samples in MindSpeed-LLM's order (``ms_llm.data.sample_order``)."""
    return bool(cfg.data.padded_samples or not cfg.data.shuffle)


def _in_mindspeed_order(cfg: RunConfig, samples):
    """The train part of ``samples`` read through MindSpeed's index of sample ids."""
    from ms_llm.data.gpt_dataset import split_indices
    from ms_llm.data.sample_order import OrderedSamples, sample_order
    t = cfg.training
    bounds = split_indices(cfg.data.split, len(samples))
    order = sample_order(bounds[0], bounds[1] - bounds[0], t.max_steps * t.global_batch_size,
                         t.seed, t.global_batch_size, shuffle=cfg.data.shuffle,
                         padded=cfg.data.padded_samples)
    return OrderedSamples(samples, order)


def _indexed_dataset(cfg: RunConfig, tokenizer: Tokenizer):
    """Megatron indexed datasets (``ms-llm preprocess`` output) as pretraining, SFT or pairwise
    (DPO) data: (train part, validation part or None)."""
    from ms_llm.data.gpt_dataset import build_pretrain_datasets
    from ms_llm.data.pairwise import stage_data_mismatch
    from ms_llm.data.sft import open_sft_dataset
    d, t = cfg.data, cfg.training
    src = cfg.source_of("data.data_path", "training.stage", "data.dataset_type")
    mismatch = stage_data_mismatch(d.data_path[0], t.stage)
    if mismatch:
        raise ConfigError(f"{src}: data.data_path: {mismatch}")
    try:
        if d.dataset_type == "sft" or t.stage == "dpo":
            samples = open_sft_dataset(d.data_path[0], d.seq_length, tokenizer.pad)
            train, valid = _split(cfg, samples)
            if _mindspeed_order(cfg):
                train = _in_mindspeed_order(cfg, samples)
            return train, valid
        out = build_pretrain_datasets(
            d.data_path, d.seq_length, [t.max_steps * t.global_batch_size, valid_samples(cfg), 0],
            seed=t.seed, eod=tokenizer.eod, split=d.split, cache_dir=d.data_cache_path,
            reset_position_ids=d.reset_position_ids,
            reset_attention_mask=d.reset_attention_mask, eod_mask_loss=d.eod_mask_loss,
            create_attention_mask=d.reset_attention_mask)
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.data_path: {e}") from None
    if out["train"] is None:
        raise ConfigError(f"data.data_path: data split {d.split!r} leaves no training documents")
    return out["train"], out["valid"]
