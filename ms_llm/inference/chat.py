"""``ChatSession``: a multi-turn conversation rendered with the tokenizer's chat template.

Why the cache survives between turns: each turn's prompt is the whole conversation rendered
again, which starts with what the cache already holds. The session keeps the tokens it fed,
crops the cache to the longest prefix they share with the new prompt (templates may re-render
earlier turns differently, e.g. Qwen3 drops past reasoning) and prefills only the rest.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import numpy as np

from ms_llm.models.kv_cache import KVCache
from .generate import generate


class ContextTooLong(ValueError):
    """The conversation no longer fits the model's context."""


class ChatSession:
    def __init__(self, model, tokenizer, eos_token_id: List[int], max_context: int,
                 system: Optional[str] = None, max_new_tokens: int = 512,
                 sampling: Optional[dict] = None, seed: Optional[int] = None,
                 say: Optional[Callable[[str], None]] = None):
        self.model, self.tokenizer = model, tokenizer
        self.say = say   # told when a reply is shortened to fit the context
        self.eos = list(eos_token_id)
        self.max_context = max_context
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling or {}
        self.seed = seed
        self.messages: List[Dict[str, str]] = ([{"role": "system", "content": system}]
                                               if system else [])
        self.cache: Optional[KVCache] = None
        self.fed = np.zeros(0, dtype=np.int64)   # the tokens whose K/V the cache holds
        self.turns = 0

    def prompt_ids(self, messages: List[Dict[str, str]]) -> List[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text)

    def send(self, text: str, streamer=None) -> str:
        """Add a user turn, generate the assistant's reply (streamed to ``streamer``), keep both
        in the conversation and return the reply text."""
        messages = self.messages + [{"role": "user", "content": text}]
        ids = np.asarray(self.prompt_ids(messages), dtype=np.int64)
        if len(ids) >= self.max_context:
            raise ContextTooLong(f"the conversation is {len(ids)} tokens, the model's context is "
                                 f"{self.max_context}")
        budget = min(self.max_new_tokens, self.max_context - len(ids))
        if budget < self.max_new_tokens and self.say is not None:
            self.say(f"reply limited to {budget} tokens (max_new_tokens {self.max_new_tokens}): "
                     f"the conversation is {len(ids)} of {self.max_context} context tokens")
        if self.cache is None:
            self.cache = KVCache.for_model(self.model, 1, len(ids) + budget,
                                           max_capacity=self.max_context)
        n = min(len(self.fed), len(ids) - 1)
        shared = int(np.argmin(np.append(self.fed[:n] == ids[:n], False)))
        self.cache.crop(min(shared, self.cache.length))
        seed = None if self.seed is None else self.seed + self.turns
        out = generate(self.model, ids[None], budget, eos_token_id=self.eos, seed=seed,
                       streamer=streamer, kv_cache=self.cache, **self.sampling)[0]
        self.fed = out[:-1]
        reply_ids = [int(t) for t in out[len(ids):] if int(t) not in self.eos]
        reply = self.tokenizer.decode(reply_ids)
        self.messages = messages + [{"role": "assistant", "content": reply}]
        self.turns += 1
        return reply
