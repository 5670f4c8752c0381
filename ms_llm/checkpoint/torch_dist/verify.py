"""Checks of a Megatron-Core ``torch_dist`` folder's ``.metadata`` against its files.

Why: the format records no checksum (torch's DCP), so what can be verified is structure: a
chunk inside its tensor with stored bytes, chunks covering the tensor, and byte ranges inside
their ``.distcp`` file that do not alias each other. ``TorchDistReader`` refuses a folder that
fails; ``ms-llm checkpoint verify`` reports it.
"""
from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

from ..hf.io import check_byte_ranges

__all__ = ["torch_dist_problem"]


def torch_dist_problem(reader) -> Optional[str]:
    """Why a ``TorchDistReader``'s folder (Megatron-Core ``torch_dist``, which records no
    checksum) cannot be read back whole, or None: every tensor chunk lies inside its tensor and
    has stored bytes, the chunks cover each tensor, and every stored byte range lies inside its
    ``.distcp`` file without overlapping another (one chunk aliasing another's bytes)."""
    ranges: Dict[str, Dict[str, Tuple[int, int]]] = {}
    for key, e in reader.tensors.items():
        total = 0
        for c in e.chunks:
            if len(c.offsets) != len(e.shape) or len(c.sizes) != len(e.shape) or any(
                    o < 0 or s < 0 or o + s > n for o, s, n in zip(c.offsets, c.sizes, e.shape)):
                return f"{reader.path}: tensor {key!r}: chunk {list(c.offsets)} + " \
                       f"{list(c.sizes)} lies outside its shape {list(e.shape)}"
            if not c.file:
                return f"{reader.path}: tensor {key!r}: the chunk at {list(c.offsets)} has no " \
                       f"stored bytes in .metadata"
            vol = 1
            for s in c.sizes:
                vol *= s
            total += vol
            ranges.setdefault(c.file, {})[f"{key}@{list(c.offsets)}"] = \
                (c.byte_offset, c.byte_offset + c.length)
        want = 1
        for s in e.shape:
            want *= s
        if total != want:
            return f"{reader.path}: tensor {key!r}: its chunks hold {total} of {want} elements"
    for key, c in reader.objects.items():
        ranges.setdefault(c.file, {})[key] = (c.byte_offset, c.byte_offset + c.length)
    for name, rs in ranges.items():
        path = os.path.join(reader.path, name)
        if os.path.basename(name) != name or not os.path.isfile(path):
            return f"{path}: listed in .metadata but missing"
        try:
            check_byte_ranges(path, rs, os.path.getsize(path))
        except ValueError as err:
            return str(err)
    return None
