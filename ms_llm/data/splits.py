"""Megatron's ``--split`` for sample-level datasets (SFT, pairwise, corpus windows).

Why: Megatron cuts a dataset into train / valid / test by ``_get_split_indices`` over its
documents; instruction and pairwise files hold one sample per document, and the corpus path's
windows are its samples, so the same boundaries over the sample count give the validation part
that evaluation reads (before, every sample outside the train part was simply dropped)."""
from __future__ import annotations

from typing import Optional, Tuple

from .gpt_dataset import split_indices


class SplitView:
    """Samples ``[lo, hi)`` of ``dataset`` (indices wrap like the datasets' own)."""

    def __init__(self, dataset, lo: int, hi: int, name: str):
        if hi <= lo:
            raise ValueError(f"the {name} split is empty")
        self.dataset, self.lo, self.hi, self.name = dataset, int(lo), int(hi), name

    def __len__(self) -> int:
        return self.hi - self.lo

    def __getitem__(self, idx: int) -> dict:
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sample {idx} out of range for {n} samples")
        return self.dataset[self.lo + idx % n]


def split_samples(dataset, split: str) -> Tuple[object, Optional[object]]:
    """(train part, validation part or None) of ``dataset`` by Megatron's split rule; the whole
    dataset is the train part when the split gives it everything."""
    n = len(dataset)
    b = split_indices(split, n)
    if b[1] <= b[0]:
        raise ValueError(f"split {split!r} leaves no training samples of {n}")
    train = dataset if (b[0], b[1]) == (0, n) else SplitView(dataset, b[0], b[1], "train")
    valid = SplitView(dataset, b[1], b[2], "validation") if b[2] > b[1] else None
    return train, valid
