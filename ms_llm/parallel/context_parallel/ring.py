"""Ring attention across a context-parallel group (Megatron's ``megatron_cp_algo``).

Each rank keeps its queries; K/V blocks travel around the ring (send to the next rank, receive
from the previous one) while the block in hand is folded into the online softmax. The backward
runs the ring again: K/V rotate as in the forward and each block's dK/dV accumulator travels
with the block it belongs to, one hop behind it, so after a full turn every accumulator is back
at the block's owner.

Overlap: on CPU, MindSpore's collectives block the calling thread, so the exchange of the next
block is issued on the communication thread (``comm.comm_thread``) and runs while this thread
computes the current block (``runtime.comm_thread: false`` turns that off, to measure it). Each
transfer is a ``broadcast`` in the two-rank group of sender and receiver (MindSpore 2.10's CPU
``send``/``recv`` look up the HCCL world group and fail). Elsewhere it is the synchronous
``comm.batch_isend_irecv`` (no overlap; not run on Ascend here).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from mindspore import Tensor, mint

from ms_llm.compat import F, is_cpu
from ms_llm.compat.autograd import Function
from ms_llm.compat.environment import setting
from .. import comm
from ..comm.comm_thread import submit
from ..comm.work import Work
from .kernel import QueryGrads, QueryState, default_scale
from .layout import ChunkMask


class _Pending:
    """A started ring shift: ``wait()`` returns the tensor received from the previous rank."""

    def __init__(self, buf: Tensor, work: Optional[Work]):
        self.buf, self.work = buf, work

    def wait(self) -> Tensor:
        if self.work is not None:
            self.work.wait()
        return self.buf


class RingExchange:
    """Shift a tensor one hop around ``ranks`` (global ranks in ring order)."""

    def __init__(self, ranks: Sequence[int]):
        self.ranks = list(ranks)
        self.size = len(self.ranks)
        me = comm.get_rank()
        self.rank = self.ranks.index(me) if self.size > 1 else 0
        self.next = self.ranks[(self.rank + 1) % self.size]
        self.prev = self.ranks[(self.rank - 1) % self.size]
        self.pairs = {}
        if self.size > 1:
            # made here, in one global order, not lazily on the communication thread
            for peer in sorted({self.next, self.prev}):
                self.pairs[peer] = comm.new_group([me, peer])

    def start(self, x: Tensor) -> _Pending:
        """Send ``x`` to the next rank and receive the previous rank's into a new buffer."""
        send = F.clone(x)            # the caller may drop or reuse ``x`` meanwhile
        buf = mint.zeros(x.shape, dtype=x.dtype)
        if not is_cpu():
            comm.batch_isend_irecv([comm.P2POp("isend", send, self.next),
                                    comm.P2POp("irecv", buf, self.prev)])
            return _Pending(buf, None)
        me = comm.get_rank()
        # one order every rank derives alike: pairs ascending, the lower rank's send first
        steps = []
        for peer in sorted({self.next, self.prev}):
            lo = min(me, peer)
            for sender in (lo, me + peer - lo):
                if sender == me and peer == self.next:
                    steps.append((send, me, self.pairs[peer]))
                elif sender == peer and peer == self.prev:
                    steps.append((buf, peer, self.pairs[peer]))

        def calls():
            for tensor, src, group in steps:
                comm.broadcast(tensor, src=src, group=group)
        if not setting("runtime.comm_thread"):
            calls()
            return _Pending(buf, None)
        return _Pending(buf, submit(calls))


class RingPlan:
    """What one ring attention call needs besides tensors: the ring, the chunks every ring
    member's K/V block covers, this rank's query chunks, the block masks and the scale."""

    def __init__(self, ring: RingExchange, member_chunks: List[List[int]],
                 q_chunks: Sequence[int], masks: ChunkMask):
        self.ring, self.member_chunks = ring, member_chunks
        self.q_chunks, self.masks = list(q_chunks), masks


def _pack(k: Tensor, v: Tensor) -> Tensor:
    return mint.cat([k.unsqueeze(0), v.unsqueeze(0)], 0)


class _RingAttention(Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, scale):
        ring, n = plan.ring, plan.ring.size
        st = QueryState(q, plan.q_chunks, k.shape[1], scale)
        kv = _pack(k, v)
        for step in range(n):
            pending = ring.start(kv) if step < n - 1 else None
            src = (ring.rank - step) % n
            st.absorb(kv[0], kv[1], plan.member_chunks[src], plan.masks)
            if pending is not None:
                kv = pending.wait()
        out, lse = st.result(q.dtype)
        ctx.saved = (q, k, v, out, lse, plan, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, plan, scale = ctx.saved
        ctx.saved = None
        ring, n = plan.ring, plan.ring.size
        g = QueryGrads(q, out, dout, lse, plan.q_chunks, k.shape[1], scale)
        kv = _pack(k, v)
        acc_pending = None
        for step in range(n):
            kv_pending = ring.start(kv) if step < n - 1 else None
            src = (ring.rank - step) % n
            dk, dv = g.block_grads(kv[0], kv[1], plan.member_chunks[src], plan.masks)
            dkv = _pack(dk, dv)
            if acc_pending is not None:
                dkv = dkv + acc_pending.wait()
            # this block's accumulator follows the block one hop behind: the last hop brings
            # it home to the owner
            acc_pending = ring.start(dkv) if n > 1 else None
            if kv_pending is not None:
                kv = kv_pending.wait()
        dkv = acc_pending.wait() if acc_pending is not None else dkv
        return (g.dq_total(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype), None, None)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, plan: RingPlan,
                   scale: Optional[float] = None) -> Tensor:
    """Causal attention of this rank's queries over the K/V of every ring member."""
    return _RingAttention.apply(q, k, v, plan, default_scale(q, scale))
