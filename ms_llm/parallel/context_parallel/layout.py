"""Where each token lives under context parallel, and which attention blocks are needed.

The sequence is cut into ``2*cp`` chunks and cp rank ``i`` holds chunks ``i`` and
``2cp-1-i`` (Megatron's load-balanced split): under a causal mask every rank then does the same
attention work. Everything here is host-side NumPy (chunk ids, the split of a loader batch,
block masks), known alike on every rank because every cp rank reads the same batch.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Union

import numpy as np
from mindspore import Tensor

MASK_VALUE = -1e30      # finite: a row masked within one block keeps a finite (ignored) LSE
SKIP, FULL = "skip", "full"
PairMask = Union[str, Tensor]


def rank_chunks(cp: int, cp_rank: int) -> List[int]:
    """The global chunk ids rank ``cp_rank`` holds, in local order."""
    return [cp_rank, 2 * cp - 1 - cp_rank]


def local_token_index(seq_len: int, cp: int, cp_rank: int) -> np.ndarray:
    """Global token positions of this rank's local sequence (its two chunks concatenated)."""
    if seq_len % (2 * cp):
        raise ValueError(f"context parallel: data.seq_length ({seq_len}) must be divisible by "
                         f"2 x parallel.context_parallel_size ({2 * cp})")
    c = seq_len // (2 * cp)
    return np.concatenate([np.arange(k * c, (k + 1) * c) for k in rank_chunks(cp, cp_rank)])


def split_sequence(arr: np.ndarray, cp: int, cp_rank: int, dim: int = 1) -> np.ndarray:
    """This rank's part of ``arr`` along its sequence dim ``dim``."""
    idx = local_token_index(arr.shape[dim], cp, cp_rank)
    return np.ascontiguousarray(np.take(arr, idx, axis=dim))


class ChunkMask:
    """Which (query chunk, key chunk) pairs of the global sequence attend, and how.

    ``pair(qc, kc)`` is ``SKIP`` (fully masked: never computed), ``FULL`` (no mask) or an
    additive fp32 bias ``[b or 1, 1, 1, c, c]``. Without ``mask`` the rule is causal by chunk
    order. ``mask`` (``[b, s, s]`` or ``[b, 1, s, s]`` bool, True = masked, the global packed-
    document mask) is combined with causality, so documents may cross chunk boundaries. Biases
    are cached: one micro-batch's plan is shared by every layer.
    """

    def __init__(self, seq_len: int, num_chunks: int, mask: Optional[np.ndarray] = None):
        if seq_len % num_chunks:
            raise ValueError(f"context parallel: sequence {seq_len} not divisible into "
                             f"{num_chunks} chunks")
        self.c = seq_len // num_chunks
        self.seq_len = seq_len
        if mask is not None:
            mask = np.asarray(mask, bool)
            if mask.ndim == 4:
                mask = mask[:, 0]
            if mask.shape[-2:] != (seq_len, seq_len):
                raise ValueError(f"context parallel: attention mask shape {mask.shape} does not "
                                 f"match the sequence length {seq_len}")
        self.mask = mask
        self._cache: Dict[tuple, PairMask] = {}   # (qc, kc) pairs and (q_chunks, k_chunks) blocks

    def pair(self, qc: int, kc: int) -> PairMask:
        key = (qc, kc)
        if key not in self._cache:
            self._cache[key] = self._classify(qc, kc)
        return self._cache[key]

    def _classify(self, qc: int, kc: int) -> PairMask:
        c = self.c
        if kc > qc:
            return SKIP
        causal = np.triu(np.ones((c, c), bool), 1) if kc == qc else np.zeros((c, c), bool)
        if self.mask is None:
            masked = causal[None]
        else:
            masked = self.mask[:, qc * c:(qc + 1) * c, kc * c:(kc + 1) * c] | causal[None]
        if masked.all():
            return SKIP
        if not masked.any():
            return FULL
        if (masked == masked[:1]).all():
            masked = masked[:1]
        bias = np.where(masked, np.float32(MASK_VALUE), np.float32(0.0))
        return Tensor(bias.reshape(masked.shape[0], 1, 1, c, c))

    def block(self, q_chunks: Sequence[int], k_chunks: Sequence[int]) -> PairMask:
        """The pairs of one (query chunks x key chunks) block as one mask: ``SKIP`` when every
        pair is, ``FULL`` when every pair is, else a bias ``[b or 1, 1, 1, nq*c, nk*c]`` with
        ``MASK_VALUE`` where a pair is skipped (rows of a query chunk can be masked in a whole
        block: their finite LSE is ignored by the merge, see ``MASK_VALUE``)."""
        key = (tuple(q_chunks), tuple(k_chunks))
        if key not in self._cache:
            self._cache[key] = self._assemble(key[0], key[1])
        return self._cache[key]

    def _assemble(self, q_chunks, k_chunks) -> PairMask:
        pairs = [[self.pair(a, b) for b in k_chunks] for a in q_chunks]
        flat = [m for row in pairs for m in row]
        if all(m is SKIP for m in flat):
            return SKIP
        if all(m is FULL for m in flat):
            return FULL
        c = self.c
        nb = max((m.shape[0] for m in flat if isinstance(m, Tensor)), default=1)
        bias = np.zeros((nb, len(q_chunks) * c, len(k_chunks) * c), np.float32)
        for i, row in enumerate(pairs):
            for j, m in enumerate(row):
                rows, cols = slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c)
                if m is SKIP:
                    bias[:, rows, cols] = MASK_VALUE
                elif m is not FULL:
                    bias[:, rows, cols] = m.asnumpy().reshape(-1, c, c)
        return Tensor(bias[:, None, None])

    def work(self, q_chunks: Sequence[int], k_chunks: Sequence[int]) -> int:
        """How many pairs of these chunks are computed (for tests and the benchmark)."""
        return sum(self.pair(a, b) is not SKIP for a in q_chunks for b in k_chunks)
