"""Context parallel of Gated DeltaNet layers: the recurrent state and the conv inputs pass from
rank to rank.

A cp rank holds two pieces of the sequence, global chunks ``r`` and ``2cp-1-r`` (the
load-balanced split the attention layers use). The recurrence runs through the chunks in order
``0, 1, ..., 2cp-1``, i.e. through the ranks ``0..cp-1`` and back. Two things cross a chunk
boundary:

* the short causal conv reads the ``K-1`` inputs before a chunk: every rank all-gathers the last
  ``K-1`` conv inputs of every chunk (a few rows) and pads each of its chunks with the previous
  chunk's (zeros before chunk 0);
* the recurrent state: each rank runs its chunks with an unknown initial state
  (``chunk_gated_delta_rule_segment``), which gives per chunk ``c`` the affine maps
  ``S_end = M_c S_in + B_c`` and ``out = out0 + P S_in``. The ``(M_c, B_c)`` of all chunks are
  all-gathered (``dk x (dk + dv)`` per head and chunk), every rank chains them in chunk order
  from a zero state (``2cp`` small matmuls) and corrects its chunks' outputs with their
  incoming state.

Both exchanges are all-gathers whose backward is a reduce-scatter (every rank's use of another
rank's piece sends its gradient back), so gradients reach every chunk's parameters and
activations exactly as in one process. Compute: the local scan carries ``dk`` more state
columns (the map ``M``); there is no serial wait between ranks.
"""
from __future__ import annotations

from typing import List, Optional

from mindspore import Tensor, mint

from ms_llm.compat import F, nn
from ms_llm.models.gated_delta_net import CausalConv1d, GatedDeltaNet
from ms_llm.models.gated_delta_rule import chunk_gated_delta_rule_segment
from .. import autograd as pa
from .layout import rank_chunks

__all__ = ["ContextParallelConv1d", "ContextParallelDeltaRule", "apply_delta_rule_context_parallel"]


def _slot(cp: int, chunk: int) -> int:
    """Position of global chunk ``chunk`` in a ``[rank0 piece0, rank0 piece1, rank1 ...]``
    gather."""
    return 2 * chunk if chunk < cp else 2 * (2 * cp - 1 - chunk) + 1


def _pieces(x: Tensor) -> List[Tensor]:
    """This rank's two chunks of a local sequence (dim 1)."""
    half = x.shape[1] // 2
    return [x[:, :half], x[:, half:]]


class ContextParallelConv1d(CausalConv1d):
    """``CausalConv1d`` over this rank's two chunks, each continuing the chunk before it
    (whichever rank holds that). Holds the full module's weight Parameter."""

    def __init__(self, full: CausalConv1d, cp):
        nn.Module.__init__(self)
        self.kernel = full.kernel
        self.weight = full.weight
        self.cp = cp

    def forward(self, x: Tensor, past: Optional[Tensor] = None) -> Tensor:
        if past is not None:
            raise ValueError("context parallel: a Gated DeltaNet conv cache (decoding) is not "
                             "built under context parallel")
        cp, keep = self.cp.cp, self.kernel - 1
        pieces = _pieces(x)
        if pieces[0].shape[1] < keep:
            raise ValueError(f"context parallel: a chunk of {pieces[0].shape[1]} tokens is "
                             f"shorter than the Gated DeltaNet conv kernel - 1 ({keep}); raise "
                             f"data.seq_length or lower parallel.context_parallel_size")
        tails = F.stack([p[:, p.shape[1] - keep:] for p in pieces], 1)   # [b, 2, K-1, C]
        tails = pa.gather_from_sequence_parallel(tails, self.cp.group, 1)  # [b, 2cp, K-1, C]
        outs = []
        for piece, chunk in zip(pieces, rank_chunks(cp, self.cp.cp_rank)):
            prev = tails[:, _slot(cp, chunk - 1)] if chunk > 0 else None
            outs.append(CausalConv1d.forward(self, piece, prev))
        return F.cat(outs, 1)


class ContextParallelDeltaRule(nn.Module):
    """Replaces ``ChunkGatedDeltaRule``: q/k/v/g/beta ``[b, s_local, h, *]`` of this rank's two
    chunks; returns their outputs (and ``None``: the final state lives on rank 0 and is only
    wanted by a decoding cache, not built under context parallel)."""

    def __init__(self, cp, chunk_size: int):
        super().__init__()
        self.cp = cp
        self.chunk_size = chunk_size

    def forward(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                initial_state: Optional[Tensor] = None):
        if initial_state is not None:
            raise ValueError("context parallel: a Gated DeltaNet state cache (decoding) is not "
                             "built under context parallel")
        cp = self.cp.cp
        b, dtype = q.shape[0], q.dtype
        # both chunks as one batch of 2b sequences
        q, k, v, g, beta = (F.cat(_pieces(t), 0) for t in (q, k, v, g, beta))
        out0, p, bias, m = chunk_gated_delta_rule_segment(q, k, v, g, beta, self.chunk_size)
        h, dk, dv = m.shape[1], m.shape[-1], bias.shape[-1]
        maps = F.cat([m, bias], -1).reshape(2, b, h, dk, dk + dv).swapaxes(0, 1)
        maps = pa.gather_from_sequence_parallel(maps, self.cp.group, 1)   # [b, 2cp, h, dk, .]
        state = mint.zeros((b, h, dk, dv), dtype=m.dtype)
        incoming = {}
        for chunk in range(2 * cp):
            incoming[chunk] = state
            mc = maps[:, _slot(cp, chunk)]
            state = F.matmul(mc[..., :dk], state) + mc[..., dk:]
        s_in = F.cat([incoming[c] for c in rank_chunks(cp, self.cp.cp_rank)], 0)
        out = out0 + F.matmul(p, s_in)                                  # [2b, h, s/2, dv]
        out = F.cat([out[:b], out[b:]], 2).swapaxes(1, 2)
        return out.astype(dtype), None


def apply_delta_rule_context_parallel(mixer: GatedDeltaNet, cp) -> None:
    """Swap one Gated DeltaNet's conv and delta rule for their context-parallel forms."""
    mixer.conv1d = ContextParallelConv1d(mixer.conv1d, cp)
    mixer.core_delta_rule = ContextParallelDeltaRule(cp, mixer.core_delta_rule.chunk_size)
