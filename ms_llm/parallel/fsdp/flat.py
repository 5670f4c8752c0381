"""One FSDP unit's parameters as one flat communication buffer (torch FSDP2's copy-in/copy-out).

Per rank the unit's flat shard is every parameter's padded dim-0 shard (C_i rows of
``prod(shape[1:])`` elements, zero tail when the rank holds fewer real rows), concatenated in
parameter order. One all-gather of that buffer per unit replaces one per parameter (on this CPU
backend each collective call costs milliseconds of fixed overhead and a barrier-like sync);
copy-out then assembles each full parameter from the W gathered buffers, skipping the padding.
Gradients go the other way: each rank's segment of every full gradient is packed, padded, into
one flat input of W x (flat shard) elements for a single reduce-scatter, and each parameter's
reduced shard is a view of the flat output (no copy).
"""
from __future__ import annotations

from typing import List, Sequence

import numpy as np
from mindspore import Tensor, mint

from ms_llm.compat import F

from ..placement import RowShard


class FlatLayout:
    """Offsets of each parameter's padded shard inside the per-rank flat buffer."""

    def __init__(self, full_shapes: Sequence[tuple], world: int, rank: int):
        self.world, self.rank = world, rank
        self.full_shapes = [tuple(s) for s in full_shapes]
        self.tails = [int(np.prod(s[1:])) for s in self.full_shapes]   # elements per row
        self.shards = [[RowShard(s[0], world, r) for r in range(world)] for s in self.full_shapes]
        self.offsets, off = [], 0
        for sh, tail in zip(self.shards, self.tails):
            self.offsets.append(off)
            off += sh[0].chunk * tail
        self.numel = off     # flat shard length per rank (padded)

    def pack_shards(self, locals_: Sequence[Tensor], dtype) -> Tensor:
        """This rank's flat shard from its real local rows (cast to ``dtype``, zero tails)."""
        pieces = []
        for i, t in enumerate(locals_):
            sh, tail = self.shards[i][self.rank], self.tails[i]
            if sh.length:
                pieces.append((t if t.dtype == dtype else t.astype(dtype)).reshape(-1))
            if sh.length < sh.chunk:
                pieces.append(mint.zeros(((sh.chunk - sh.length) * tail,), dtype=dtype))
        return pieces[0] if len(pieces) == 1 else mint.cat(pieces)

    def unpack_full(self, parts: Sequence[Tensor]) -> List[Tensor]:
        """Every full parameter from the W gathered flat shards: a fresh, contiguous tensor each
        (never a view of ``parts``: its storage is freed and refilled on its own)."""
        fulls = []
        for i, shape in enumerate(self.full_shapes):
            pieces = [mint.narrow(parts[r], 0, self.offsets[i], sh.length * self.tails[i])
                      for r, sh in enumerate(self.shards[i]) if sh.length]
            flat = mint.cat(pieces) if len(pieces) > 1 else F.clone(pieces[0])
            fulls.append(flat.reshape(shape))
        return fulls

    def pack_grads(self, grads: Sequence[Tensor], dtype) -> Tensor:
        """The reduce-scatter input: for rank r = 0..W-1, each parameter's rows of rank r (zero
        tail to C rows), so rank r's output slice is its flat shard."""
        grads = [g if g.dtype == dtype else g.astype(dtype) for g in grads]
        pieces = []
        for r in range(self.world):
            for i, g in enumerate(grads):
                sh, tail = self.shards[i][r], self.tails[i]
                if sh.length:
                    rows = g if sh.length == self.full_shapes[i][0] else \
                        mint.narrow(g, 0, sh.start, sh.length)
                    pieces.append(rows.reshape(-1))
                if sh.length < sh.chunk:
                    pieces.append(mint.zeros(((sh.chunk - sh.length) * tail,), dtype=dtype))
        return mint.cat(pieces)

    def shard_views(self, flat: Tensor) -> List[Tensor]:
        """Each parameter's real local rows as a view of this rank's flat shard ``flat``."""
        out = []
        for i, shape in enumerate(self.full_shapes):
            sh = self.shards[i][self.rank]
            out.append(mint.narrow(flat, 0, self.offsets[i], sh.length * self.tails[i])
                       .reshape((sh.length,) + shape[1:]))
        return out
