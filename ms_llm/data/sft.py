"""Fine-tuning datasets over ``ms-llm preprocess`` outputs: SFT (plain or packed) and pairwise (DPO).

Why: instruction files store *unshifted* ``input_ids``/``labels`` (labels -100 off the loss), as
the PyTorch lane writes them; training needs next-token labels, a loss mask, and for packed rows
per-sample causal masks and restarting position ids. Every item has exactly ``seq_length``
positions: ``tokens = ids``, ``labels[t] = labels_stored[t + 1]`` (the last position and every
position whose next token lies in another packed sample are ignored). Ignored labels are set to
0 (a valid id) with ``loss_mask`` 0, so loss kernels never index with -100.
"""
from __future__ import annotations

from typing import Dict, Optional

import numpy as np

from .handlers import IGNORE_INDEX
from .indexed import IndexedDataset, dataset_exists
from .packing import causal_segment_mask, segment_position_ids


def _prefix(base: str, key: str) -> str:
    return f"{base}_packed_{key}_document"


def _open(base: str, keys) -> Dict[str, IndexedDataset]:
    out = {}
    for k in keys:
        p = _prefix(base, k)
        if not dataset_exists(p):
            raise FileNotFoundError(f"missing {p}.bin/.idx (run `ms-llm preprocess` with an instruction handler)")
        out[k] = IndexedDataset(p)
    n = {k: len(v) for k, v in out.items()}
    if len(set(n.values())) != 1:
        raise ValueError(f"{base}: datasets disagree on the sample count {n}")
    return out


def shift_and_pad(ids: np.ndarray, labels: np.ndarray, segments: np.ndarray, seq_length: int, pad_id: int) -> Dict[str, np.ndarray]:
    """One ``seq_length`` row: tokens, next-token labels, loss mask, position ids, segment ids."""
    n = min(len(ids), seq_length)
    tokens = np.full(seq_length, pad_id, dtype=np.int32)
    seg = np.zeros(seq_length, dtype=np.int64)
    stored = np.full(seq_length + 1, IGNORE_INDEX, dtype=np.int64)
    tokens[:n] = ids[:n]
    seg[:n] = segments[:n]
    stored[:n] = labels[:n]
    nxt = stored[1:].copy()
    seg_next = np.concatenate([seg[1:], [0]])
    nxt[(seg_next != seg) | (seg == 0)] = IGNORE_INDEX  # never predict across a packed-sample boundary
    loss_mask = (nxt != IGNORE_INDEX).astype(np.float32)
    nxt[nxt == IGNORE_INDEX] = 0
    return {"tokens": tokens, "labels": nxt.astype(np.int32), "loss_mask": loss_mask,
            "position_ids": segment_position_ids(seg).astype(np.int32), "segment_ids": seg.astype(np.int32)}


class SFTDataset:
    """Reads ``<prefix>_packed_{input_ids,attention_mask,labels}_document``.

    Packed rows (``attention_mask`` holding sample numbers 1..k) get per-sample causal masks and
    positions; plain rows are single samples (padded / truncated to ``seq_length``) with a causal
    mask. ``attention_mask`` in the output is bool ``[1, s, s]``, True = masked.
    """

    def __init__(self, prefix: str, seq_length: int, pad_id: int, create_attention_mask: bool = True):
        self.prefix = prefix
        self.seq_length = int(seq_length)
        self.pad_id = int(pad_id)
        self.create_attention_mask = create_attention_mask
        self._ds = _open(prefix, ("input_ids", "attention_mask", "labels"))

    def __len__(self) -> int:
        return len(self._ds["input_ids"])

    def __getitem__(self, idx: int) -> dict:
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sample {idx} out of range for {n} samples")
        idx %= n
        ids = self._ds["input_ids"][idx]
        labels = self._ds["labels"][idx]
        am = np.asarray(self._ds["attention_mask"][idx], dtype=np.int64)
        if len(ids) != len(labels) or len(ids) != len(am):
            raise ValueError(f"{self.prefix}: sample {idx} has mismatched input_ids/labels/attention_mask lengths")
        row = shift_and_pad(ids, labels, am, self.seq_length, self.pad_id)
        if self.create_attention_mask:
            row["attention_mask"] = causal_segment_mask(row["segment_ids"])
        return row


class PairwiseDataset:
    """Reads ``<prefix>_packed_{chosen,rejected}_{input_ids,labels}_document`` for DPO; each side
    is shifted/padded like ``SFTDataset`` (keys prefixed ``chosen_`` / ``rejected_``)."""

    KEYS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")

    def __init__(self, prefix: str, seq_length: int, pad_id: int):
        self.prefix = prefix
        self.seq_length = int(seq_length)
        self.pad_id = int(pad_id)
        self._ds = _open(prefix, self.KEYS)

    def __len__(self) -> int:
        return len(self._ds["chosen_input_ids"])

    def __getitem__(self, idx: int) -> dict:
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sample {idx} out of range for {n} samples")
        idx %= n
        out: Dict[str, np.ndarray] = {}
        for side in ("chosen", "rejected"):
            ids = self._ds[f"{side}_input_ids"][idx]
            row = shift_and_pad(ids, self._ds[f"{side}_labels"][idx], np.ones(len(ids), np.int64), self.seq_length, self.pad_id)
            for k in ("tokens", "labels", "loss_mask", "position_ids"):
                out[f"{side}_{k}"] = row[k]
        return out


def open_sft_dataset(prefix: str, seq_length: int, pad_id: int, **kwargs) -> Optional[object]:
    """SFT or pairwise dataset, whichever files exist at ``prefix``."""
    if dataset_exists(_prefix(prefix, "chosen_input_ids")):
        return PairwiseDataset(prefix, seq_length, pad_id)
    return SFTDataset(prefix, seq_length, pad_id, **kwargs)
