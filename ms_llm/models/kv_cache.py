"""Key/value cache for incremental decoding: preallocated per-layer K/V written in place.

Why preallocated: decoding appends one position per step; concatenating the history every step
would copy O(length) per layer per token and allocate a new buffer each time. Here each layer
owns ``[b, ng, capacity, d]`` K and V buffers; a step writes its ``s`` new positions at the fill
point and attention reads the filled part ``[:, :, :length]``.

The layer's buffers are allocated on its first write, from the shapes it writes: the model reads
its number of local query groups from ``linear_qkv``'s output width (tensor parallel shards it),
so the cache must not guess it from the config either.

Slots are shared by the batch: left-padded prompts put their padding in the first slots, which
``padding`` marks (never attended). ``attention_mask`` builds the Megatron-convention mask (True =
masked) over the slots for the next ``s`` queries: causal within the step, padding everywhere
(None without padding: the attention's causal mask aligned to the last query is the same).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
from mindspore import Tensor

from ms_llm.compat import F


class LayerKVCache:
    """One layer's K/V ``[b, ng, capacity, d]`` and its fill ``length``."""

    def __init__(self, capacity: int, max_capacity: Optional[int] = None):
        self.capacity = capacity
        self.max_capacity = max_capacity or capacity
        self.length = 0
        self.k: Optional[Tensor] = None
        self.v: Optional[Tensor] = None

    def update(self, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
        """Write ``k``, ``v`` ``[b, ng, s, d]`` at the fill point; return K, V over every filled
        slot (``[b, ng, length, d]``, the new positions included)."""
        s = k.shape[2]
        end = self.length + s
        if self.k is None:
            self.capacity = max(self.capacity, end)
            self.k, self.v = (F.zeros(k.shape[0], k.shape[1], self.capacity, k.shape[3],
                                      dtype=k.dtype) for _ in range(2))
        elif end > self.capacity:
            self._grow(end)
        # Tensor.__setitem__ is MindSpore's in-place slice write (a view's copy_ does not write
        # through to the buffer on CPU in MindSpore 2.10).
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def _grow(self, needed: int) -> None:
        """Double the buffers (one copy of the history, amortised O(1) per token)."""
        if needed > self.max_capacity:
            raise ValueError(f"KV cache full: {needed} positions needed, at most "
                             f"{self.max_capacity}")
        cap = min(max(needed, 2 * self.capacity), self.max_capacity)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = F.zeros(old.shape[0], old.shape[1], cap, old.shape[3], dtype=old.dtype)
            new[:, :, :self.length] = old[:, :, :self.length]
            setattr(self, name, new)
        self.capacity = cap


class KVCache:
    """The cache of a whole model: one ``LayerKVCache`` per decoder layer (``cache[i]``), the
    padded slots and the shared fill length.

    ``capacity`` is allocated up front; with ``max_capacity`` larger the buffers double when a
    write needs more (a chat whose length is not known in advance)."""

    def __init__(self, num_layers: int, batch_size: int, capacity: int,
                 max_capacity: Optional[int] = None):
        self.batch_size = batch_size
        self.layers: List[LayerKVCache] = [LayerKVCache(capacity, max_capacity)
                                           for _ in range(num_layers)]
        self.max_capacity = max(capacity, max_capacity or capacity)
        self.padding = np.zeros((batch_size, self.max_capacity), dtype=bool)

    @classmethod
    def for_model(cls, model, batch_size: int, capacity: int,
                  max_capacity: Optional[int] = None) -> "KVCache":
        return cls(len(model.decoder.layers), batch_size, capacity, max_capacity)

    def __getitem__(self, i: int) -> LayerKVCache:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def length(self) -> int:
        """Filled slots (the position of the next write)."""
        return self.layers[0].length if self.layers else 0

    def mark_padding(self, padding: np.ndarray) -> None:
        """``padding`` ``[b, s]`` (True = pad) describes the next ``s`` slots to be written."""
        padding = np.asarray(padding, dtype=bool)
        start = self.length
        self._check(start + padding.shape[1])
        self.padding[:, start:start + padding.shape[1]] = padding

    def _check(self, needed: int) -> None:
        if needed > self.max_capacity:
            raise ValueError(f"KV cache full: {needed} positions needed, at most "
                             f"{self.max_capacity}")

    def crop(self, length: int) -> None:
        """Forget every slot from ``length`` on (a chat whose new prompt shares only a prefix
        with what the cache holds)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"crop({length}): the cache holds {self.length} positions")
        for layer in self.layers:
            layer.length = length
        self.padding[:, length:] = False

    def attention_mask(self, s: int) -> Optional[Tensor]:
        """Bool ``[b, 1, s, length + s]`` for the next ``s`` queries (True = masked): key slot
        ``j`` is hidden from query slot ``i`` when ``j > i`` or ``j`` is padding. None when no
        slot is padding: attention's own causal mask, aligned to the last query, is the same
        (and takes the fused kernels where they exist)."""
        start = self.length
        total = start + s
        self._check(total)
        pad = self.padding[:, :total]
        if not pad.any():
            return None
        causal = np.arange(total)[None, :] > np.arange(start, total)[:, None]     # [s, total]
        return Tensor(causal[None, None] | pad[:, None, None, :])
