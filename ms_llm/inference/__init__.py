"""Inference: ``generate`` (greedy / sampled decoding over a KV cache, batched left-padded
prompts, streaming), ``ChatSession`` (multi-turn chat with the tokenizer's template) and the
loaders behind ``ms-llm generate`` / ``ms-llm chat``."""
from ms_llm.models.kv_cache import KVCache
from .chat import ChatSession
from .generate import generate
from .sampling import filter_logits, filtered_probs
from .streamer import TextStreamer

__all__ = ["generate", "KVCache", "ChatSession", "TextStreamer", "filter_logits",
           "filtered_probs"]
