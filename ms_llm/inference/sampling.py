"""Next-token choice: greedy, or sampling from the temperature / top-k / top-p filtered softmax.

Why NumPy on the host: the generation loop needs every step's token on the host anyway (EOS,
streaming), the vocabulary row is small, and a NumPy ``Generator`` gives seeded draws that do
not depend on MindSpore's device RNG. The filters follow HF's logits warpers, in HF's order
(temperature, then top-k, then top-p), with HF's tie and keep-at-least-one rules.
"""
from __future__ import annotations

from typing import Optional

import numpy as np


def filter_logits(logits: np.ndarray, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0) -> np.ndarray:
    """``logits`` ``[b, V]`` -> float64 scores with the filtered-out tokens at ``-inf``.

    * temperature: divide by it (must be > 0);
    * top_k > 0: drop every token scoring below the k-th largest (ties with it stay);
    * top_p < 1: sort ascending, drop the tokens whose cumulative probability is
      ``<= 1 - top_p`` (the most likely token always stays)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    scores = np.asarray(logits, dtype=np.float64) / temperature
    if top_k and top_k < scores.shape[-1]:
        kth = -np.partition(-scores, top_k - 1, axis=-1)[:, top_k - 1:top_k]
        scores = np.where(scores < kth, -np.inf, scores)
    if top_p < 1.0:
        order = np.argsort(scores, axis=-1, kind="stable")          # ascending
        ascending = np.take_along_axis(scores, order, -1)
        cumulative = np.cumsum(_softmax(ascending), axis=-1)
        remove = cumulative <= 1.0 - top_p
        remove[:, -1] = False
        drop = np.zeros_like(remove)
        np.put_along_axis(drop, order, remove, -1)
        scores = np.where(drop, -np.inf, scores)
    return scores


def filtered_probs(logits: np.ndarray, temperature: float = 1.0, top_k: int = 0,
                   top_p: float = 1.0) -> np.ndarray:
    """The distribution ``sample`` draws from: softmax of ``filter_logits``."""
    return _softmax(filter_logits(logits, temperature, top_k, top_p))


def sample(logits: np.ndarray, rng: np.random.Generator, temperature: float = 1.0,
           top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """One token id per row of ``logits`` ``[b, V]``, drawn with ``rng`` (inverse CDF)."""
    probs = filtered_probs(logits, temperature, top_k, top_p)
    cdf = np.cumsum(probs, axis=-1)
    u = rng.random(probs.shape[0]) * cdf[:, -1]
    ids = np.array([np.searchsorted(c, x, side="right") for c, x in zip(cdf, u)])
    ids = np.minimum(ids, probs.shape[-1] - 1)
    # A draw landing exactly on a boundary never picks a filtered (zero-probability) token.
    bad = probs[np.arange(len(ids)), ids] == 0
    if bad.any():
        ids[bad] = np.argmax(probs[bad], axis=-1)
    return ids.astype(np.int64)


def greedy(logits: np.ndarray) -> np.ndarray:
    """Argmax per row (the first index on ties, as torch.argmax)."""
    return np.argmax(np.asarray(logits), axis=-1).astype(np.int64)


def next_tokens(logits: np.ndarray, do_sample: bool, rng: Optional[np.random.Generator],
                temperature: float, top_k: int, top_p: float) -> np.ndarray:
    if not do_sample:
        return greedy(logits)
    return sample(logits, rng, temperature, top_k, top_p)


def _softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x, axis=-1, keepdims=True)
    e = np.exp(x - np.where(np.isfinite(m), m, 0.0))
    return e / e.sum(axis=-1, keepdims=True)
