"""Blockwise attention with online softmax: the arithmetic every context-parallel variant runs.

Queries and keys are lists of sequence chunks (``ChunkMask`` ids). For each query chunk the
state is (``out``, ``lse``) in fp32; each key block updates it with the running-max /
running-sum merge (flash attention's online softmax), so no rank ever holds a score matrix wider
than one chunk pair. The backward recomputes each pair's probabilities from the saved global LSE
(``P = exp(S - lse)``) and yields ``dq`` plus ``dk``/``dv`` for every key block, which is what
a ring sends back to the block's owner. Fully masked pairs are skipped in both passes.

Tensors: q ``[b, nh, Sq, d]``, k/v ``[b, ng, Sk, d]`` (``nh % ng == 0``, grouped-query heads:
query head h reads kv head ``h // (nh/ng)``), with ``Sq = len(q_chunks) * c``.
``attention_over_blocks`` is the single-process entry (local q against a sequence of K/V
blocks, autograd through a hand-written backward); ``ring.py`` drives the same functions with
the K/V blocks arriving over the network.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

from mindspore import Tensor, mint

from ms_llm.compat import float32
from ms_llm.compat.autograd import Function
from ms_llm.ops import cpu_kernels
from ms_llm.ops.attention import pair_kernel_enabled
from ms_llm.ops.linear import bmm
from .layout import FULL, SKIP, ChunkMask


# ------------------------------------------------------------------------------ grouped views
def group_queries(q: Tensor, ng: int, n_chunks: int) -> List[Tensor]:
    """q ``[b, nh, n*c, d]`` -> per chunk ``[b, ng, r*c, d]`` fp32 (the heads of one KV group
    folded into rows, so K/V are never expanded)."""
    b, nh, s, d = q.shape
    r, c = nh // ng, s // n_chunks
    q5 = q.astype(float32).reshape(b, ng, r, s, d)
    return [q5[:, :, :, i * c:(i + 1) * c].reshape(b, ng, r * c, d) for i in range(n_chunks)]


def ungroup(chunks: List[Tensor], nh: int) -> Tensor:
    """Inverse of ``group_queries``: per-chunk ``[b, ng, r*c, d]`` -> ``[b, nh, n*c, d]``."""
    b, ng, rc, d = chunks[0].shape
    r = nh // ng
    c = rc // r
    parts = [x.reshape(b, ng, r, c, d) for x in chunks]
    return mint.cat(parts, 3).reshape(b, nh, len(chunks) * c, d)


def key_chunks(k: Tensor, n_chunks: int) -> List[Tensor]:
    c = k.shape[2] // n_chunks
    k = k.astype(float32)
    return [k[:, :, i * c:(i + 1) * c].contiguous() for i in range(n_chunks)]


def _scores(qg: Tensor, k: Tensor, bias, scale: float, r: int) -> Tensor:
    s = bmm(qg, k, transpose_b=True) * scale          # [b, ng, r*c, ck]
    if bias is FULL:
        return s
    b, ng, rc, ck = s.shape
    return (s.reshape(b, ng, r, rc // r, ck) + bias).reshape(b, ng, rc, ck)


# ------------------------------------------------------------------------------ per-pair math
# On CPU each pair is one C++ kernel per direction (``cpu_kernels.pair_attention``: the ~20
# composed ops below were 29 % of a cp = 2 step, mostly broadcast elementwise ops); the composed
# form is the reference and every other device's path.
def _kernel_bias(bias):
    """ChunkMask's ``FULL`` or bias ``[nb, 1, 1, c, ck]`` as the kernel's operand."""
    return None if bias is FULL else bias.reshape(bias.shape[0], bias.shape[-2], bias.shape[-1])


def pair_forward(qg: Tensor, k: Tensor, v: Tensor, bias, scale: float, r: int
                 ) -> Tuple[Tensor, Tensor]:
    """Softmax attention of one (query chunk, key chunk) pair: normalised output and LSE."""
    if pair_kernel_enabled():
        return cpu_kernels.pair_attention(qg, k, v, _kernel_bias(bias), scale)
    s = _scores(qg, k, bias, scale, r)
    m = mint.amax(s, -1, keepdim=True)
    p = mint.exp(s - m)
    l_ = p.sum(-1, keepdims=True)
    out = bmm(p, v) / l_
    return out, (m + mint.log(l_)).squeeze(-1)


def merge(state: Optional[Tuple[Tensor, Tensor]], out: Tensor, lse: Tensor
          ) -> Tuple[Tensor, Tensor]:
    """Online-softmax merge of two partial results over disjoint keys."""
    if state is None:
        return out, lse
    o0, l0 = state
    mx = mint.maximum(l0, lse)
    e0, e1 = mint.exp(l0 - mx), mint.exp(lse - mx)
    new = mx + mint.log(e0 + e1)
    return (o0 * mint.exp(l0 - new).unsqueeze(-1) + out * mint.exp(lse - new).unsqueeze(-1),
            new)


def pair_backward(qg: Tensor, k: Tensor, v: Tensor, dout: Tensor, delta: Tensor, lse: Tensor,
                  bias, scale: float, r: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Recompute ``P = exp(S - lse)`` for the pair and return its (dq, dk, dv) contributions."""
    if pair_kernel_enabled():
        return cpu_kernels.pair_attention_grads(qg, k, v, dout, delta, lse, _kernel_bias(bias),
                                                scale)
    p = mint.exp(_scores(qg, k, bias, scale, r) - lse.unsqueeze(-1))
    dv = bmm(p, dout, transpose_a=True)
    dp = bmm(dout, v, transpose_b=True)
    ds = p * (dp - delta.unsqueeze(-1)) * scale
    return bmm(ds, k), bmm(ds, qg, transpose_a=True), dv


# ------------------------------------------------------------------------------ block level
# Chunks of at most this many tokens are computed one whole K/V block at a time (one masked
# product per block), longer ones chunk pair by chunk pair (masked pairs never computed). Short
# chunks make the per-pair ops overhead-bound (PyNative dispatch, ~20 ops per pair and (2cp)^2/2
# pairs), long ones FLOP-bound, where skipping the masked pairs inside a block saves up to half
# of its work. benchmarks/context_parallel.py --kernel measures the crossover.
FUSED_BLOCK_MAX_CHUNK = 64


def fused_blocks(chunk_len: int) -> bool:
    return chunk_len <= FUSED_BLOCK_MAX_CHUNK


def _grouped(x: Tensor, ng: int) -> Tensor:
    """``[b, nh, S, d]`` -> ``[b, ng, r*S, d]`` fp32: all chunks at once (fused mode)."""
    b, nh, s, d = x.shape
    return x.astype(float32).reshape(b, ng, nh // ng, s, d).reshape(b, ng, (nh // ng) * s, d)


def _ungrouped(x: Tensor, nh: int) -> Tensor:
    b, ng, rs, d = x.shape
    return x.reshape(b, ng, nh // ng, rs * ng // nh, d).reshape(b, nh, rs * ng // nh, d)


class QueryState:
    """The grouped queries and the running (out, lse): per query chunk, or for all of this
    rank's query chunks together when ``fused_blocks`` (then one entry)."""

    def __init__(self, q: Tensor, q_chunks: Sequence[int], ng: int, scale: float):
        self.nh, self.ng, self.r = q.shape[1], ng, q.shape[1] // ng
        self.q_chunks, self.scale = list(q_chunks), scale
        self.fused = fused_blocks(q.shape[2] // len(q_chunks))
        self.qg = [_grouped(q, ng)] if self.fused else group_queries(q, ng, len(q_chunks))
        self.state: List[Optional[Tuple[Tensor, Tensor]]] = [None] * len(self.qg)

    def absorb(self, k: Tensor, v: Tensor, k_chunks: Sequence[int], masks: ChunkMask) -> None:
        """Fold one K/V block (its chunks ``k_chunks``) into the queries' state."""
        if self.fused:
            bias = masks.block(self.q_chunks, k_chunks)
            if bias is not SKIP:
                out, lse = pair_forward(self.qg[0], k.astype(float32), v.astype(float32), bias,
                                        self.scale, self.r)
                self.state[0] = merge(self.state[0], out, lse)
            return
        ks, vs = key_chunks(k, len(k_chunks)), key_chunks(v, len(k_chunks))
        for i, qc in enumerate(self.q_chunks):
            for j, kc in enumerate(k_chunks):
                bias = masks.pair(qc, kc)
                if bias is SKIP:
                    continue
                out, lse = pair_forward(self.qg[i], ks[j], vs[j], bias, self.scale, self.r)
                self.state[i] = merge(self.state[i], out, lse)

    def result(self, dtype) -> Tuple[Tensor, List[Tensor]]:
        for i, st in enumerate(self.state):
            if st is None:
                raise ValueError(f"context parallel: query chunk(s) "
                                 f"{self.q_chunks if self.fused else self.q_chunks[i]} attend to "
                                 f"no key (every block masked)")
        outs = [st[0] for st in self.state]
        out = _ungrouped(outs[0], self.nh) if self.fused else ungroup(outs, self.nh)
        return out.astype(dtype), [st[1] for st in self.state]


class QueryGrads:
    """The backward's inputs (grouped q, dout, delta, lse) and dq accumulators, per query chunk
    or fused like ``QueryState`` (same rule, so the forward's LSE list lines up)."""

    def __init__(self, q: Tensor, out: Tensor, dout: Tensor, lse: List[Tensor],
                 q_chunks: Sequence[int], ng: int, scale: float):
        n = len(q_chunks)
        self.nh, self.ng, self.r = q.shape[1], ng, q.shape[1] // ng
        self.q_chunks, self.scale, self.lse = list(q_chunks), scale, lse
        self.fused = fused_blocks(q.shape[2] // n)
        if self.fused:
            self.qg, self.dog, og = _grouped(q, ng), _grouped(dout, ng), _grouped(out, ng)
            self.qg, self.dog, og = [self.qg], [self.dog], [og]
        else:
            self.qg, self.dog = group_queries(q, ng, n), group_queries(dout, ng, n)
            og = group_queries(out, ng, n)
        self.delta = [(a * b).sum(-1) for a, b in zip(self.dog, og)]
        self.dq: List[Optional[Tensor]] = [None] * len(self.qg)

    def block_grads(self, k: Tensor, v: Tensor, k_chunks: Sequence[int], masks: ChunkMask
                    ) -> Tuple[Tensor, Tensor]:
        """This rank's queries' contribution to dK/dV of one K/V block (and dq, accumulated)."""
        if self.fused:
            bias = masks.block(self.q_chunks, k_chunks)
            k32, v32 = k.astype(float32), v.astype(float32)
            if bias is SKIP:
                return mint.zeros(k32.shape, dtype=float32), mint.zeros(v32.shape, dtype=float32)
            dq, dk, dv = pair_backward(self.qg[0], k32, v32, self.dog[0], self.delta[0],
                                       self.lse[0], bias, self.scale, self.r)
            self.dq[0] = dq if self.dq[0] is None else self.dq[0] + dq
            return dk, dv
        n = len(k_chunks)
        ks, vs = key_chunks(k, n), key_chunks(v, n)
        dks: List[Optional[Tensor]] = [None] * n
        dvs: List[Optional[Tensor]] = [None] * n
        for i, qc in enumerate(self.q_chunks):
            for j, kc in enumerate(k_chunks):
                bias = masks.pair(qc, kc)
                if bias is SKIP:
                    continue
                dq, dk, dv = pair_backward(self.qg[i], ks[j], vs[j], self.dog[i],
                                           self.delta[i], self.lse[i], bias, self.scale, self.r)
                self.dq[i] = dq if self.dq[i] is None else self.dq[i] + dq
                dks[j] = dk if dks[j] is None else dks[j] + dk
                dvs[j] = dv if dvs[j] is None else dvs[j] + dv
        zero = mint.zeros(ks[0].shape, dtype=float32)
        return (mint.cat([x if x is not None else zero for x in dks], 2),
                mint.cat([x if x is not None else zero for x in dvs], 2))

    def dq_total(self, dtype) -> Tensor:
        zero = mint.zeros(self.qg[0].shape, dtype=float32)
        dq = [x if x is not None else zero for x in self.dq]
        return (_ungrouped(dq[0], self.nh) if self.fused else ungroup(dq, self.nh)).astype(dtype)


def default_scale(q: Tensor, scale: Optional[float]) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


# ------------------------------------------------------------------------------ single process
class _BlockAttention(Function):
    @staticmethod
    def forward(ctx, q, q_chunks, k_chunk_lists, masks, scale, *kvs):
        n = len(k_chunk_lists)
        ks, vs = kvs[:n], kvs[n:]
        st = QueryState(q, q_chunks, ks[0].shape[1], scale)
        for k, v, kc in zip(ks, vs, k_chunk_lists):
            st.absorb(k, v, kc, masks)
        out, lse = st.result(q.dtype)
        ctx.args = (q, out, lse, q_chunks, k_chunk_lists, masks, scale, ks, vs)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, out, lse, q_chunks, k_chunk_lists, masks, scale, ks, vs = ctx.args
        ctx.args = None
        g = QueryGrads(q, out, dout, lse, q_chunks, ks[0].shape[1], scale)
        dks, dvs = [], []
        for k, v, kc in zip(ks, vs, k_chunk_lists):
            dk, dv = g.block_grads(k, v, kc, masks)
            dks.append(dk.astype(k.dtype))
            dvs.append(dv.astype(v.dtype))
        return (g.dq_total(q.dtype), None, None, None, None) + tuple(dks) + tuple(dvs)


def attention_over_blocks(q: Tensor, q_chunks: Sequence[int],
                          blocks: Sequence[Tuple[Tensor, Tensor, Sequence[int]]],
                          masks: ChunkMask, scale: Optional[float] = None) -> Tensor:
    """Attention of local queries (global chunks ``q_chunks``) over K/V blocks
    ``(k, v, k_chunks)``, with a hand-written backward that recomputes per pair and returns
    dK/dV for each block. Returns ``[b, nh, Sq, d]`` in q's dtype."""
    ks = [b[0] for b in blocks]
    vs = [b[1] for b in blocks]
    kcs = [list(b[2]) for b in blocks]
    return _BlockAttention.apply(q, list(q_chunks), kcs, masks, default_scale(q, scale),
                                 *ks, *vs)
