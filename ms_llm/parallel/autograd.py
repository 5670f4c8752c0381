"""Differentiable collectives for use inside models (Megatron's ``mappings.py``).

Each pair is the other's backward: copy <-> all-reduce, all-gather <-> reduce-scatter,
all-to-all <-> its reverse. MindSpore's own autograd through collectives is unreliable on CPU
(MindSpore 2.10 computes wrong gradients through list ``all_gather`` and in-place ``all_reduce``,
and raises through the ``AllGather``/``ReduceScatter``/``AlltoAll`` primitives), so every
backward here is explicit. PyNative only (``compat.autograd.Function``).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from mindspore import Tensor, mint

from ms_llm.compat import F
from ms_llm.compat.autograd import Function
from . import comm


def _all_reduce(x: Tensor, group) -> Tensor:
    out = F.clone(x)
    comm.all_reduce(out, group=group)
    return out


def _gather(x: Tensor, dim: int, group) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in group-rank order."""
    if group.size == 1:
        return x
    dim = dim % x.ndim
    front = x.swapaxes(0, dim).contiguous() if dim else x
    out = mint.zeros((front.shape[0] * group.size,) + tuple(front.shape[1:]), dtype=x.dtype)
    comm.all_gather_into_tensor(out, front, group=group)
    return out.swapaxes(0, dim).contiguous() if dim else out


def _reduce_scatter(x: Tensor, dim: int, group) -> Tensor:
    if group.size == 1:
        return x
    dim = dim % x.ndim
    if x.shape[dim] % group.size:
        raise ValueError(f"reduce-scatter: dim {dim} of size {x.shape[dim]} is not divisible by "
                         f"the group size {group.size}")
    front = x.swapaxes(0, dim).contiguous() if dim else x
    out = mint.zeros((front.shape[0] // group.size,) + tuple(front.shape[1:]), dtype=x.dtype)
    comm.reduce_scatter_tensor(out, front, group=group)
    return out.swapaxes(0, dim).contiguous() if dim else out


def _split(x: Tensor, dim: int, group) -> Tensor:
    if group.size == 1:
        return x
    n = x.shape[dim] // group.size
    return mint.narrow(x, dim, group.rank * n, n).contiguous()


class _CopyToGroup(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x * 1

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFromGroup(Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _SumOverGroup(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


def _along_dim(name: str, fwd, bwd, doc: str = ""):
    """A Function that runs ``fwd(x, dim, group)`` forward and ``bwd(g, dim, group)`` backward:
    Megatron's mappings are pairs of one collective and its adjoint."""
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return fwd(x, dim, group)

    def backward(ctx, g):
        return bwd(g, ctx.dim, ctx.group), None, None
    return type(name, (Function,), {"forward": staticmethod(forward),
                                    "backward": staticmethod(backward), "__doc__": doc})


_GatherFromGroup = _along_dim("_GatherFromGroup", _gather, _split)
_ScatterToGroup = _along_dim("_ScatterToGroup", _split, _gather)
_GatherFromSequenceParallel = _along_dim(
    "_GatherFromSequenceParallel", _gather, _reduce_scatter,
    "All-gather along the sequence; backward reduce-scatters (Megatron SP).")
_ReduceScatterToSequenceParallel = _along_dim("_ReduceScatterToSequenceParallel",
                                              _reduce_scatter, _gather)


class _AllToAll(Function):
    @staticmethod
    def forward(ctx, x, matrix, group):
        ctx.matrix, ctx.group = matrix, group
        out = mint.zeros((int(matrix[:, group.rank].sum()),) + tuple(x.shape[1:]), dtype=x.dtype)
        comm.all_to_all_v(out, x, matrix, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        m, group = ctx.matrix, ctx.group
        dx = mint.zeros((int(m[group.rank].sum()),) + tuple(g.shape[1:]), dtype=g.dtype)
        comm.all_to_all_v(dx, g.contiguous(), m.T, group=group)
        return dx, None, None


def _trivial(group) -> bool:
    return group is None or group.size == 1


def copy_to_group(x: Tensor, group) -> Tensor:
    """Identity forward; all-reduce of the gradient (the input of a column-parallel layer)."""
    return x if _trivial(group) else _CopyToGroup.apply(x, group)


def reduce_from_group(x: Tensor, group) -> Tensor:
    """All-reduce forward; identity backward (the output of a row-parallel layer)."""
    return x if _trivial(group) else _ReduceFromGroup.apply(x, group)


def sum_over_group(x: Tensor, group) -> Tensor:
    """All-reduce (sum) forward and backward: every rank's copy of the sum feeds its own loss
    term, so the gradient of the summed terms with respect to this rank's ``x`` is the sum of
    the incoming gradients over the group (unlike ``reduce_from_group``, whose consumers
    compute the same replicated thing and pass the gradient through)."""
    return x if _trivial(group) else _SumOverGroup.apply(x, group)


def gather_from_group(x: Tensor, group, dim: int = -1) -> Tensor:
    return x if _trivial(group) else _GatherFromGroup.apply(x, dim, group)


def scatter_to_group(x: Tensor, group, dim: int = -1) -> Tensor:
    return x if _trivial(group) else _ScatterToGroup.apply(x, dim, group)


def gather_from_sequence_parallel(x: Tensor, group, dim: int = 1) -> Tensor:
    return x if _trivial(group) else _GatherFromSequenceParallel.apply(x, dim, group)


def reduce_scatter_to_sequence_parallel(x: Tensor, group, dim: int = 1) -> Tensor:
    return x if _trivial(group) else _ReduceScatterToSequenceParallel.apply(x, dim, group)


def all_to_all(x: Tensor, group, output_split_sizes: Sequence[int],
               input_split_sizes: Sequence[int], split_matrix=None) -> Tensor:
    """Differentiable ``all_to_all_single`` along dim 0 (backward sends the gradients back).
    ``split_matrix`` (``[i, j]`` = rows rank i sends to rank j), when the caller already has it,
    saves the exchange of split sizes."""
    if _trivial(group):
        return x
    if split_matrix is None:
        split_matrix = comm.exchange_split_sizes(list(input_split_sizes), group)
    m = np.asarray(split_matrix, np.int64)
    if [int(v) for v in m[:, group.rank]] != [int(v) for v in output_split_sizes]:
        raise ValueError(f"all_to_all: output_split_sizes {list(output_split_sizes)} disagree "
                         f"with what the peers send {m[:, group.rank].tolist()}")
    return _AllToAll.apply(x, m, group)
