"""Key/value cache for incremental decoding: preallocated per-layer K/V written in place.

Why preallocated: decoding appends one position per step; concatenating the history every step
would copy O(length) per layer per token and allocate a new buffer each time. Here each layer
owns ``[b, ng, capacity, d]`` K and V buffers; a step writes its ``s`` new positions at the fill
point (``Tensor.__setitem__``, MindSpore's in-place slice write) and nothing else is copied.

What the queries attend over: the first write (the prompt, into an empty cache) attends over
the new K/V themselves, a plain causal square that keeps the fused attention kernels. Every
later step attends over the whole buffer with the unfilled slots masked
(``ops.cache_attention``): the filled prefix ``[:, :, :length]`` is a strided view, which
MindSpore 2.10 copies to contiguous memory at ~0.2 GB/s on CPU, so the whole buffer goes to the
kernel, which reads only the slots up to the last visible one; ``reserve`` grows the buffers
before the mask is built, so mask and buffers agree. On CPU a one-token step of a plain layer
skips all of this: ``ms_llm.models.fused_decode`` writes the slot and attends inside one kernel.

The layer's buffers are allocated on its first write, from the shapes it writes: the model reads
its number of local query groups from ``linear_qkv``'s output width (tensor parallel shards it),
so the cache must not guess it from the config either.

Slots are shared by the batch: left-padded prompts put their padding in the first slots, which
``padding`` marks (never attended).
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
        self.max_capacity = max(capacity, max_capacity or capacity)
        self.length = 0
        self.k: Optional[Tensor] = None
        self.v: Optional[Tensor] = None
        # The fused decode step's arguments for this layer (ms_llm.models.fused_decode), found
        # on the first one-token step: None = not looked at yet, False = not covered.
        self.fused = None

    def update(self, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
        """Write ``k``, ``v`` ``[b, ng, s, d]`` at the fill point. Returns what the queries attend
        over: ``k``, ``v`` themselves for the first write, else the whole buffers
        (``[b, ng, capacity, d]``; the caller masks the slots from ``length`` on)."""
        s = k.shape[2]
        start, end = self.length, self.length + s
        self.reserve(end)
        if self.k is None:
            self.k, self.v = (F.zeros(k.shape[0], k.shape[1], self.capacity, k.shape[3],
                                      dtype=k.dtype) for _ in range(2))
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.length = end
        if start == 0:
            return k, v
        return self.k, self.v

    def reserve(self, needed: int) -> None:
        """Make room for ``needed`` slots: double the capacity (one copy of the history,
        amortised O(1) per token), up to ``max_capacity``."""
        if needed <= self.capacity:
            return
        if needed > self.max_capacity:
            raise ValueError(f"KV cache full: {needed} positions needed, at most "
                             f"{self.max_capacity}")
        cap = min(max(needed, 2 * self.capacity), self.max_capacity)
        if self.k is not None:
            for name in ("k", "v"):
                old = getattr(self, name)
                new = F.zeros(old.shape[0], old.shape[1], cap, old.shape[3], dtype=old.dtype)
                new[:, :, :self.length] = old[:, :, :self.length]
                setattr(self, name, new)
        self.capacity = cap


class KVCache:
    """The cache of a whole model: one ``LayerKVCache`` per decoder layer (``cache[i]``), the
    padded slots and the shared fill length.

    ``capacity`` slots are allocated up front; with ``max_capacity`` larger the buffers double
    when a write needs more (a chat whose length is not known in advance)."""

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
        cache = cls(len(model.decoder.layers), batch_size, capacity, max_capacity)
        for i, layer in enumerate(model.decoder.layers):
            # a token mixer with state of its own (Gated DeltaNet) makes its slot
            make = getattr(layer.self_attention, "make_cache", None)
            if make is not None:
                cache.layers[i] = make(cache)
        return cache

    def __getitem__(self, i: int) -> LayerKVCache:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def length(self) -> int:
        """Filled slots (the position of the next write)."""
        return self.layers[0].length if self.layers else 0

    @property
    def capacity(self) -> int:
        return self.layers[0].capacity if self.layers else 0

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
        """The mask (bool, True = masked) of the next ``s`` queries over what they attend
        (see ``LayerKVCache.update``). Into an empty cache: ``[b, 1, s, s]`` causal + padding,
        or None without padding (the attention's own causal mask). Later: ``[b or 1, 1, s,
        capacity]`` hiding slot ``j`` from query ``i`` (slot ``length + i``) when ``j > length
        + i`` (the future and the unfilled slots) or ``j`` is padding. Grows the buffers first
        (``reserve``), so the mask spans them."""
        start = self.length
        total = start + s
        self._check(total)
        for layer in self.layers:
            layer.reserve(total)
        cols = s if start == 0 else self.capacity
        pad = self.padding[:, :cols]
        if start == 0 and not pad.any():
            return None
        hidden = np.arange(cols)[None, :] > np.arange(start, total)[:, None]      # [s, cols]
        if not pad.any():
            return Tensor(hidden[None, None])
        return Tensor(hidden[None, None] | pad[:, None, None, :])
