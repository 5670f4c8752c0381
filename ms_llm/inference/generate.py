"""``generate``: autoregressive decoding of a ``GPTModel`` with a KV cache, HF-style.

Why it looks like HF's ``generate``: users bring HF habits (greedy by default, ``do_sample`` with
temperature / top-k / top-p, ``eos_token_id``, left padding with ``attention_mask``, a streamer
with ``put`` / ``end``, the prompt returned in front of the new tokens). The model is the
training model itself: the cache is an optional argument of its forward (``ms_llm.models.
kv_cache``), so there is no second implementation to drift from the trained one.

Batches of prompts of different lengths are left-padded: every row's newest token sits in the
same cache slot, so one decode step serves the whole batch. Padding slots are masked out of
attention and positions count only real tokens (HF's ``cumsum(attention_mask) - 1``), so a
padded row computes exactly what it computes alone.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
from mindspore import Tensor

from ms_llm.compat import no_grad
from ms_llm.compat.environment import explicit
from ms_llm.models import fused_decode
from ms_llm.models.kv_cache import KVCache
from .sampling import next_tokens

Prompts = Union[np.ndarray, Sequence[Sequence[int]]]


def left_pad(input_ids: Prompts, attention_mask: Optional[np.ndarray] = None,
             pad_token_id: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """``(ids [b, s] int64, mask [b, s] bool)``: ragged lists are left-padded with
    ``pad_token_id``; a given ``attention_mask`` (1 = token) must have its zeros on the left."""
    if isinstance(input_ids, np.ndarray) or (len(input_ids) and np.ndim(input_ids[0]) == 0):
        ids = np.atleast_2d(np.asarray(input_ids, dtype=np.int64))
        mask = (np.ones(ids.shape, bool) if attention_mask is None
                else np.asarray(attention_mask).astype(bool).reshape(ids.shape))
    else:
        if attention_mask is not None:
            raise ValueError("attention_mask goes with a padded [b, s] array, not ragged lists")
        rows = [np.asarray(r, dtype=np.int64).reshape(-1) for r in input_ids]
        s = max(len(r) for r in rows)
        ids = np.full((len(rows), s), pad_token_id, dtype=np.int64)
        mask = np.zeros((len(rows), s), dtype=bool)
        for i, r in enumerate(rows):
            if len(r):
                ids[i, s - len(r):], mask[i, s - len(r):] = r, True
    if ids.shape[1] == 0 or not mask.any(axis=1).all():
        raise ValueError("every prompt needs at least one token")
    if (np.diff(mask.astype(np.int8), axis=1) < 0).any():
        raise ValueError("attention_mask has padding after a token: pad prompts on the left")
    return ids, mask


def _eos_set(eos_token_id: Union[None, int, Iterable[int]]) -> List[int]:
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, (int, np.integer)):
        return [int(eos_token_id)]
    return [int(e) for e in eos_token_id]


def generate(model, input_ids: Prompts, max_new_tokens: int, do_sample: bool = False,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             eos_token_id: Union[None, int, Iterable[int]] = None, seed: Optional[int] = None,
             streamer=None, *, attention_mask: Optional[np.ndarray] = None,
             pad_token_id: Optional[int] = None, use_cache: bool = True,
             kv_cache: Optional[KVCache] = None, vocab_size: Optional[int] = None) -> np.ndarray:
    """Continue every prompt by up to ``max_new_tokens`` tokens; return ``[b, s + new]`` ids
    (the left-padded prompts, then the new tokens; ``new`` <= ``max_new_tokens``, fewer when
    every row has produced an EOS).

    * ``do_sample`` False: greedy; True: draw from the temperature / top-k / top-p filtered
      softmax with ``np.random.default_rng(seed)`` (same seed, same tokens).
    * ``eos_token_id`` (one id or several): a row that produced one is finished; it gets
      ``pad_token_id`` (default: the first EOS id, else 0) from then on.
    * ``streamer``: ``put(prompt ids [b, s])`` once, ``put(new ids [b])`` per step, ``end()``
      (HF's protocol; see ``TextStreamer``).
    * ``use_cache`` False recomputes the whole sequence every step (reference / benchmark).
    * ``kv_cache``: continue a cache that already holds the first ``kv_cache.length`` tokens of
      ``input_ids`` (a chat); only the rest is prefilled. It is left holding every token fed.
    * ``vocab_size``: choose among the first ``vocab_size`` logits only (a padded vocabulary).
    """
    eos = _eos_set(eos_token_id)
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    ids, mask = left_pad(input_ids, attention_mask, pad)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if streamer is not None:
        streamer.put(ids)
    rng = np.random.default_rng(seed) if do_sample else None
    was_training = model.training
    model.set_train(False)
    try:
        with no_grad():
            new = _decode(model, ids, mask, max_new_tokens, eos, pad, rng, streamer, use_cache,
                          kv_cache, dict(do_sample=do_sample, temperature=temperature,
                                         top_k=top_k, top_p=top_p), vocab_size)
    finally:
        model.set_train(was_training)
    if streamer is not None:
        streamer.end()
    return np.concatenate([ids] + [t[:, None] for t in new], axis=1)


def _decode(model, ids, mask, max_new_tokens, eos, pad, rng, streamer, use_cache, kv_cache,
            sampling, vocab_size) -> List[np.ndarray]:
    b = ids.shape[0]
    if max_new_tokens == 0:
        return []
    step = (_CachedSteps(model, ids, mask, max_new_tokens, kv_cache) if use_cache
            else _RecomputeSteps(model, ids, mask))
    logits = step.prefill()
    finished = np.zeros(b, dtype=bool)
    out = []
    # greedy: a fused step may return the argmax itself (no logits through the host sampler)
    argmax_vocab = 0 if sampling["do_sample"] else (vocab_size or logits.shape[-1])
    chosen = None
    with _single_blas_thread(use_cache):
        for i in range(max_new_tokens):
            if chosen is not None:
                tok = chosen
            else:
                scores = logits[:, :vocab_size] if vocab_size else logits
                tok = next_tokens(scores, rng=rng, **sampling)
            tok = np.where(finished, pad, tok)
            if eos:
                finished |= np.isin(tok, eos)
            out.append(tok)
            if streamer is not None:
                streamer.put(tok)
            if finished.all() or i + 1 == max_new_tokens:
                break
            logits, chosen = step.next(tok, argmax_vocab)
    return out


@contextlib.contextmanager
def _single_blas_thread(enabled: bool) -> Iterator[None]:
    """One OpenBLAS thread for the one-token steps (unless ``runtime.blas_threads`` says
    otherwise). Their GEMMs are matrix-vector products too small to share, and an idle
    OpenBLAS thread spin-waits after each one on the core the next MindSpore op needs:
    measured on the 2-core VM, 450-575 ms per token with 2 threads against ~80 with 1. The
    whole-model fused step (``fused_decode.model_step``) shares its large products over the
    cores on threads of its own, which call OpenBLAS on one thread each."""
    if not enabled or explicit("runtime.blas_threads"):
        yield
        return
    from ms_llm.ops.cpu_kernels.gemm import blas
    if not blas.blas_available():
        yield
        return
    before = blas.blas_threads()
    blas.set_blas_threads(1)
    try:
        yield
    finally:
        blas.set_blas_threads(before)


class _CachedSteps:
    """Prefill the prompt once into the cache, then feed one token per step."""

    def __init__(self, model, ids, mask, max_new_tokens, kv_cache):
        b, s = ids.shape
        self.model, self.ids, self.mask = model, ids, mask
        self.cache = kv_cache or KVCache.for_model(model, b, s + max_new_tokens)
        if self.cache.batch_size != b:
            raise ValueError(f"kv_cache holds {self.cache.batch_size} rows, the prompts {b}")
        self.padded = not mask.all()
        self.fast = None      # the whole-model fused step, found on the first next()
        self.positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)

    def prefill(self) -> np.ndarray:
        start = self.cache.length
        if start >= self.ids.shape[1]:
            raise ValueError(f"kv_cache already holds {start} positions; the prompt has "
                             f"{self.ids.shape[1]} (nothing left to prefill)")
        self.cache.mark_padding(~self.mask[:, start:])
        pos = Tensor(self.positions[:, start:].astype(np.int32)) if self.padded else None
        self.next_pos = self.positions[:, -1] + 1
        return self._run(self.ids[:, start:], pos)

    def next(self, tok: np.ndarray, argmax_vocab: int = 0):
        """``(logits [b, V], tokens [b] or None)`` of the step feeding ``tok``; the tokens are
        the greedy choice among the first ``argmax_vocab`` logits when the fused whole-model
        step (``fused_decode.model_step``) ran and ``argmax_vocab`` > 0."""
        self.cache.mark_padding(np.zeros((tok.shape[0], 1), dtype=bool))
        positions = self.next_pos
        self.next_pos = self.next_pos + 1
        if self.fast is None:
            self.fast = fused_decode.model_step(self.model, self.cache) or False
        if self.fast:
            slot = self.cache.length
            for layer in self.cache.layers:
                layer.reserve(slot + 1)
            logits, chosen = self.fast([(c.k, c.v) for c in self.cache.layers], tok, positions,
                                       self.cache.padding, slot, argmax_vocab)
            for layer in self.cache.layers:
                layer.length = slot + 1
            return logits, chosen
        pos = Tensor(positions[:, None].astype(np.int32)) if self.padded else None
        return self._run(tok[:, None], pos), None

    def _run(self, ids: np.ndarray, pos: Optional[Tensor]) -> np.ndarray:
        logits = self.model(Tensor(ids.astype(np.int32)), position_ids=pos,
                            kv_cache=self.cache, logits_to_keep=1)
        return logits.asnumpy()[:, -1]


class _RecomputeSteps:
    """No cache: run the whole sequence again for every new token."""

    def __init__(self, model, ids, mask):
        self.model, self.ids, self.mask = model, ids, mask

    def prefill(self) -> np.ndarray:
        return self._run()

    def next(self, tok: np.ndarray, argmax_vocab: int = 0):
        self.ids = np.concatenate([self.ids, tok[:, None]], axis=1)
        self.mask = np.concatenate([self.mask, np.ones((tok.shape[0], 1), bool)], axis=1)
        return self._run(), None

    def _run(self) -> np.ndarray:
        mask = pos = None
        if not self.mask.all():
            s = self.ids.shape[1]
            causal = np.triu(np.ones((s, s), dtype=bool), 1)
            mask = Tensor(causal[None, None] | ~self.mask[:, None, None, :])
            pos = Tensor(np.maximum(np.cumsum(self.mask, axis=1) - 1, 0).astype(np.int32))
        logits = self.model(Tensor(self.ids.astype(np.int32)), attention_mask=mask,
                            position_ids=pos, logits_to_keep=1)
        return logits.asnumpy()[:, -1]
