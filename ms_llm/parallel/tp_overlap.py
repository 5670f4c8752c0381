"""Tensor-parallel communication overlap under sequence parallel (Megatron's
``--tp-comm-overlap``, MindSpeed's CoC): the sequence all-gather and reduce-scatter around the
column- and row-parallel GEMMs are cut into the ranks' sequence pieces, so one piece's exchange
runs while another piece's GEMM computes.

* Column-parallel (``all-gather -> X W^T``): the other ranks' pieces start moving, this rank's
  own piece is multiplied meanwhile, then the received pieces. Backward, in reverse: the received
  pieces' input gradients go back to their owners while this rank's own piece's gradient is
  computed, and the owner adds what it receives (the reduce-scatter, split the same way).
* Row-parallel (``X W^T -> reduce-scatter``): the partial outputs of the other ranks' pieces are
  computed first and start moving to their owners while this rank's own piece is multiplied;
  the owner adds what it receives. Backward: the output gradient goes to every other rank (the
  all-gather) while the own piece's gradients are computed.

Two autograd Functions bracket each exchange (``start`` and ``finish``); the second's backward
starts the backward exchange and the first's waits for it, with the own piece's GEMM backward in
between: MindSpore's PyNative autograd runs the nodes in reverse order of recording, and the
``start`` node cannot run before ``finish`` (it consumes its gradient), so the order always
holds. The GEMM itself is the layer's own kernel (``local_matmul``: fp32, bf16, MXFP8), applied
per piece; the weight gradient is the sum of the pieces' (the same terms in another order).

On CPU the exchanges are ``comm.batch_isend_irecv``, which runs them on the communication
thread (``runtime.comm_thread``) while this thread computes. On Ascend they are the same
point-to-point calls, synchronous there (so correct but without overlap); MindSpore's fused
matmul-communication kernels (``all_gather_matmul`` / ``matmul_reduce_scatter``) are not wired in:
no Ascend device has run this path.
"""
from __future__ import annotations

from typing import Callable, List

from mindspore import Tensor, mint

from ms_llm.compat import F
from ms_llm.compat.autograd import Function
from . import comm


class _Exchange:
    """Per-call state shared by a ``start``/``finish`` pair: the pending transfers and the
    buffers they fill."""

    def __init__(self, group, dim: int):
        self.group, self.dim = group, dim
        self.peers: List[int] = [r for r in group.ranks if r != comm.get_rank()]
        self.work: list = []
        self.bufs: List[Tensor] = []

    def start(self, sends: List[Tensor], like: Tensor) -> None:
        """Send ``sends[i]`` to ``peers[i]`` and receive one tensor shaped like ``like`` from
        each peer (in the communication thread's queue order, which every rank shares)."""
        self.bufs = [mint.zeros(like.shape, dtype=like.dtype) for _ in self.peers]
        ops = []
        for peer, x, buf in zip(self.peers, sends, self.bufs):
            ops += [comm.P2POp("isend", x, peer), comm.P2POp("irecv", buf, peer)]
        self.work = comm.batch_isend_irecv(ops)

    def wait(self) -> List[Tensor]:
        for w in self.work:
            w.wait()
        self.work = []
        bufs, self.bufs = self.bufs, []
        return bufs


def _pieces(x: Tensor, dim: int, n: int) -> List[Tensor]:
    size = x.shape[dim] // n
    return [mint.narrow(x, dim, i * size, size).contiguous() for i in range(n)]


def _sum_in_rank_order(mine: Tensor, received: List[Tensor], my_index: int) -> Tensor:
    """``sum_r part_r`` with every rank's part in group-rank order (this rank's at
    ``my_index``), as the reduce-scatter it replaces adds them."""
    parts = received[:my_index] + [mine] + received[my_index:]
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


# --------------------------------------------------------------------------- column parallel
class _GatherStart(Function):
    """Identity on this rank's piece; starts sending it to the other ranks."""

    @staticmethod
    def forward(ctx, x, ex):
        ctx.ex = ex
        ex.start([x] * len(ex.peers), x)
        return x * 1

    @staticmethod
    def backward(ctx, g):
        ex = ctx.ex
        # the other ranks' gradients for this rank's piece (started by _GatherFinish.backward)
        return _sum_in_rank_order(g, ex.wait(), ex.group.rank), None


class _GatherFinish(Function):
    """The other ranks' pieces, concatenated along ``dim`` in group-rank order (``dep`` orders
    it after ``_GatherStart``; it carries no gradient)."""

    @staticmethod
    def forward(ctx, dep, ex):
        ctx.ex, ctx.like = ex, dep
        return mint.cat(ex.wait(), dim=ex.dim)

    @staticmethod
    def backward(ctx, g):
        ex = ctx.ex
        ex.start(_pieces(g, ex.dim, len(ex.peers)), ctx.like)   # each piece back to its owner
        return F.zeros_like(ctx.like), None


def gathered_matmul(x: Tensor, matmul: Callable[[Tensor], Tensor], group, dim: int = 1) -> Tensor:
    """``matmul(all_gather(x, dim))`` with the gather overlapped (this rank's piece first)."""
    if group.size == 1:
        return matmul(x)
    ex = _Exchange(group, dim)
    mine = _GatherStart.apply(x, ex)
    y_mine = matmul(mine)
    y_others = matmul(_GatherFinish.apply(mine, ex))
    r, n = group.rank, x.shape[dim]
    parts = [mint.narrow(y_others, dim, 0, r * n)] if r else []
    parts.append(y_mine)
    if r < group.size - 1:
        parts.append(mint.narrow(y_others, dim, r * n, (group.size - 1 - r) * n))
    return mint.cat(parts, dim=dim)


# --------------------------------------------------------------------------- row parallel
class _ScatterStart(Function):
    """Identity on the other ranks' partial outputs; starts sending each to its owner."""

    @staticmethod
    def forward(ctx, y_others, ex):
        ctx.ex = ex
        sends = _pieces(y_others, ex.dim, len(ex.peers))
        ex.start(sends, sends[0])
        return y_others * 1

    @staticmethod
    def backward(ctx, g):
        ex = ctx.ex
        # the owners' output gradients for those pieces (started by _ScatterFinish.backward)
        return mint.cat(ex.wait(), dim=ex.dim), None


class _ScatterFinish(Function):
    """This rank's output piece: its own partial plus the other ranks' partials for it."""

    @staticmethod
    def forward(ctx, y_mine, dep, ex):
        ctx.ex, ctx.dep = ex, dep
        return _sum_in_rank_order(y_mine, ex.wait(), ex.group.rank)

    @staticmethod
    def backward(ctx, g):
        ex = ctx.ex
        ex.start([g] * len(ex.peers), g)                # the output gradient to every other rank
        return g, F.zeros_like(ctx.dep), None


def matmul_scattered(x: Tensor, matmul: Callable[[Tensor], Tensor], group,
                     dim: int = 1) -> Tensor:
    """``reduce_scatter(matmul(x), dim)`` with the reduction overlapped (the other ranks'
    pieces first)."""
    if group.size == 1:
        return matmul(x)
    ex = _Exchange(group, dim)
    pieces = _pieces(x, dim, group.size)
    r = group.rank
    others = mint.cat(pieces[:r] + pieces[r + 1:], dim=dim)
    y_others = _ScatterStart.apply(matmul(others), ex)
    y_mine = matmul(pieces[r])
    return _ScatterFinish.apply(y_mine, y_others, ex)


def open_exchanges(group) -> None:
    """Create the point-to-point groups the exchanges use now, in one order on every rank (not
    lazily inside a backward)."""
    comm.open_pairs([r for r in group.ranks if r != comm.get_rank()])
