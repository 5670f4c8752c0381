"""Sequence packing: bin-packing samples into fixed-length rows, and the per-document attention
masks and position ids that keep packed documents from seeing each other.

Why: packing removes padding waste, but only stays equivalent to training the documents one by
one if (a) no token attends across a document boundary and (b) RoPE positions restart at every
document. Masks follow the model's convention: bool ``[1, s, s]``, ``True`` = masked.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> List[List[int]]:
    """Bin-pack item indices (longest first, first bin that fits) into bins of ``capacity``.

    Deterministic: ties keep input order. Items longer than ``capacity`` are an error (the
    caller truncates first).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    bins: List[List[int]] = []
    room: List[int] = []
    for i in order:
        n = int(lengths[i])
        if n > capacity:
            raise ValueError(f"item {i} of length {n} exceeds the pack capacity {capacity}")
        for b, r in enumerate(room):
            if n <= r:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return bins


def causal_segment_mask(segment_ids: np.ndarray) -> np.ndarray:
    """``[1, s, s]`` bool, True = masked: query ``q`` sees key ``k`` iff ``k <= q`` and both are in
    the same segment. Padding (segment 0) rows see only themselves, so softmax never gets an
    all-masked row (their labels are ignored anyway)."""
    seg = np.asarray(segment_ids)
    s = seg.shape[0]
    allowed = (seg[:, None] == seg[None, :]) & np.tri(s, dtype=bool)
    pad = seg == 0
    allowed[pad, :] = False
    allowed[np.arange(s)[pad], np.arange(s)[pad]] = True
    return ~allowed[None]


def segment_position_ids(segment_ids: np.ndarray) -> np.ndarray:
    """Positions restarting at 0 at every segment change (padding counts as its own segment)."""
    seg = np.asarray(segment_ids)
    s = seg.shape[0]
    idx = np.arange(s, dtype=np.int64)
    starts = np.ones(s, dtype=bool)
    starts[1:] = seg[1:] != seg[:-1]
    start_of = np.maximum.accumulate(np.where(starts, idx, 0))
    return idx - start_of


def eod_segments(tokens: np.ndarray, eod: int) -> np.ndarray:
    """Segment id per position: number of ``eod`` tokens strictly before it, plus one (the eod
    closing a document belongs to that document, as in Megatron)."""
    is_eod = np.asarray(tokens) == eod
    before = np.concatenate([[0], np.cumsum(is_eod)[:-1]]) if len(is_eod) else np.zeros(0, np.int64)
    return before.astype(np.int64) + 1


def ltor_masks_and_position_ids(tokens: np.ndarray, eod: int, reset_position_ids: bool, reset_attention_mask: bool,
                                eod_mask_loss: bool, create_attention_mask: bool = True):
    """Megatron's ``_get_ltor_masks_and_position_ids`` on one sample (vectorised, numpy).

    Returns ``(attention_mask [1,s,s] bool True=masked or None, loss_mask [s] float32,
    position_ids [s] int64)``.
    """
    tokens = np.asarray(tokens)
    s = tokens.shape[0]
    loss_mask = np.ones(s, dtype=np.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod] = 0.0
    seg = eod_segments(tokens, eod)
    position_ids = segment_position_ids(seg) if reset_position_ids else np.arange(s, dtype=np.int64)
    attention_mask: Optional[np.ndarray] = None
    if create_attention_mask:
        if reset_attention_mask:
            attention_mask = causal_segment_mask(seg)
        else:
            attention_mask = ~np.tri(s, dtype=bool)[None]
    return attention_mask, loss_mask, position_ids
