"""CPU compositions of the collectives MindSpore's CPU backend (mccl) has no kernel for.

mccl registers ``all_reduce``, list ``all_gather``, ``broadcast``, ``gather`` and ``scatter``
only; ``all_gather_into_tensor``, ``reduce_scatter_tensor`` and ``all_to_all_single`` are built
here from those, each with the least traffic the available kernels allow (the op table is in the
package docstring). Callers have already checked shapes and handled groups of size 1.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import numpy as np
from mindspore import Tensor, mint

from ms_llm.compat import F
from ms_llm.compat.environment import setting

from .backend import dist, log_once
from .comm_thread import submit
from .groups import ProcessGroup
from .work import Work, finish

# The composition reduce_scatter_tensor uses ("scatter" or "all_reduce");
# benchmarks/collectives.py measures both.
CPU_REDUCE_SCATTER = "scatter"

# Deterministic mode (``set_deterministic``): sum/avg all-reduces add the ranks' tensors in rank
# order (``all_reduce_in_rank_order``) instead of mccl's own order.
_DETERMINISTIC = [False]


def set_deterministic(enabled: bool) -> None:
    """Fixed, rank-ordered reductions in every CPU collective composition (on Ascend HCCL's
    ``HCCL_DETERMINISTIC`` does this; ``mindspore.set_deterministic`` sets it)."""
    _DETERMINISTIC[0] = bool(enabled)


def is_deterministic() -> bool:
    return _DETERMINISTIC[0]


_COMBINE = {"sum": lambda a, b: a + b, "avg": lambda a, b: a + b, "prod": lambda a, b: a * b,
            "max": lambda a, b: mint.maximum(a, b), "min": lambda a, b: mint.minimum(a, b)}


def issue(kernels: Callable[[bool], list], async_op: bool,
          then: Optional[Callable[[], None]] = None) -> Optional[Work]:
    """Issue mccl kernels on CPU: ``kernels(async_op)`` launches them (every buffer already made
    by the caller) and returns their handles; ``then`` completes the op on the caller's thread.
    Asynchronous requests run the kernels on the communication thread, because MindSpore's CPU
    collectives block their caller even with ``async_op=True`` (so FSDP's prefetched gathers,
    the bucketed gradient all-reduces and the reduce-scatters would not overlap anything);
    ``runtime.comm_thread: false`` keeps them inline, to measure what that is worth."""
    if async_op and setting("runtime.comm_thread"):
        return submit(lambda: kernels(False), then=then)
    handles = kernels(async_op)
    return finish(Work(handles if async_op else [], then), async_op)


def all_gather_into_tensor(output: Tensor, input: Tensor, g: ProcessGroup,
                           async_op: bool) -> Optional[Work]:
    """List ``all_gather`` into per-rank buffers, then one ``cat`` into ``output``."""
    log_once("all_gather_into_tensor", "CPU: list all_gather + cat")
    parts = [mint.zeros(input.shape, dtype=input.dtype) for _ in range(g.size)]
    return issue(lambda a: [dist().all_gather(parts, input, group=g.name, async_op=a)], async_op,
                 lambda: output.copy_(mint.cat(parts, 0)))


def reduce_scatter_tensor(output: Tensor, input: Tensor, op: str, g: ProcessGroup,
                          async_op: bool) -> Optional[Work]:
    """The composition chosen by ``CPU_REDUCE_SCATTER``; ``op`` is already normalised."""
    if CPU_REDUCE_SCATTER == "scatter":
        log_once("reduce_scatter_tensor", "CPU: one scatter per root + local combine")
        return reduce_scatter_by_scatter(output, input, op, g, async_op)
    log_once("reduce_scatter_tensor", "CPU: all_reduce on a copy + narrow (2x traffic)")
    return reduce_scatter_by_all_reduce(output, input, op, g, async_op)


def all_reduce_in_rank_order(tensor: Tensor, op: str, g: ProcessGroup,
                             async_op: bool) -> Optional[Work]:
    """Deterministic-mode sum/avg: list ``all_gather``, then ``((r0 + r1) + r2) + ...`` in rank
    order on every rank, so every rank holds the same bits whatever mccl's algorithm does
    (W x N bytes received instead of a ring's 2(W-1)/W x N)."""
    log_once("all_reduce(deterministic)", "CPU: list all_gather + sum in rank order")
    parts = [mint.zeros(tensor.shape, dtype=tensor.dtype) for _ in range(g.size)]

    def then():
        acc = parts[0]
        for p in parts[1:]:
            acc = acc + p
        F.copy_(tensor, acc / g.size if op == "avg" else acc)
    return issue(lambda a: [dist().all_gather(parts, tensor, group=g.name, async_op=a)],
                 async_op, then)


def reduce_scatter_by_all_reduce(output: Tensor, input: Tensor, op: str, g: ProcessGroup,
                                 async_op: bool) -> Optional[Work]:
    """All-reduce a copy of the whole input, keep this rank's slice (2(W-1)/W x N bytes sent)."""
    buf = F.clone(input)
    n = output.shape[0]

    def then():
        piece = mint.narrow(buf, 0, g.rank * n, n)
        F.copy_(output, piece / g.size if op == "avg" else piece)
    if is_deterministic() and op in ("sum", "avg"):   # the rank-order sum, then the slice
        h = all_reduce_in_rank_order(buf, "sum", g, async_op)   # a Work when async: waitable
        return finish(Work([h] if async_op else [], then), async_op)
    return issue(lambda a: [dist().all_reduce(buf, op="sum" if op == "avg" else op,
                                              group=g.name, async_op=a)], async_op, then)


def reduce_scatter_by_scatter(output: Tensor, input: Tensor, op: str, g: ProcessGroup,
                              async_op: bool) -> Optional[Work]:
    """Rank j's slice of every rank's input reaches rank j through one ``scatter`` rooted at each
    rank (W calls; the slices are views, not copies); rank j then combines the W slices in rank
    order. Each rank sends (W-1)/W x N bytes, what a native reduce-scatter moves."""
    n, w = output.shape[0], g.size
    chunks = [mint.narrow(input, 0, j * n, n) for j in range(w)]
    bufs = [mint.zeros(output.shape, dtype=output.dtype) for _ in range(w)]

    def kernels(a: bool) -> list:
        return [dist().scatter(buf, chunks if root == g.rank else [], src=g.global_rank(root),
                               group=g.name, async_op=a) for root, buf in enumerate(bufs)]

    def then():
        acc = bufs[0]
        for b in bufs[1:]:
            acc = _COMBINE[op](acc, b)
        F.copy_(output, acc / w if op == "avg" else acc)
    return issue(kernels, async_op, then)


def all_to_all(output: Tensor, input: Tensor, in_splits, matrix: np.ndarray, g: ProcessGroup,
               async_op: bool) -> Optional[Work]:
    """One ``scatter`` per root; with ``async_op`` its kernels run on the communication thread
    (``runtime.comm_thread: false``: inline, for measuring what the overlap is worth)."""
    log_once("all_to_all_single", "CPU: one scatter per root, rows padded to the root's max")
    calls, assemble = all_to_all_plan(output, input, in_splits, matrix, g)
    if async_op and setting("runtime.comm_thread"):
        return submit(calls, then=assemble)
    calls()
    assemble()
    return finish(Work(), async_op)


def all_to_all_plan(output: Tensor, input: Tensor, in_splits, matrix: np.ndarray,
                    g: ProcessGroup) -> Tuple[Callable[[], None], Callable[[], None]]:
    """The scatter-per-root composition as ``(calls, assemble)``: every buffer is made here,
    ``calls()`` only issues the ``scatter`` kernels (what the communication thread runs), and
    ``assemble()`` writes ``output`` from the received buffers (on the caller's thread)."""
    w = g.size
    tail = tuple(input.shape[1:])
    offsets = np.concatenate([[0], np.cumsum(in_splits)])
    rounds = []
    for root in range(w):
        pad = int(matrix[root].max())
        if pad == 0:
            continue
        if root == g.rank:
            chunks = []
            for j in range(w):
                piece = mint.narrow(input, 0, int(offsets[j]), in_splits[j])
                if in_splits[j] < pad:
                    filler = mint.zeros((pad - in_splits[j],) + tail, dtype=input.dtype)
                    piece = mint.cat([piece, filler], 0) if in_splits[j] else filler
                chunks.append(piece.contiguous())
        else:   # ignored off the root, but the kernel wants a list: one buffer, W references
            chunks = [mint.zeros((pad,) + tail, dtype=input.dtype)] * w
        rounds.append((root, chunks, mint.zeros((pad,) + tail, dtype=input.dtype)))

    def calls():
        for root, chunks, buf in rounds:
            dist().scatter(buf, chunks, src=g.global_rank(root), group=g.name)

    def assemble():
        received = [mint.narrow(buf, 0, 0, int(matrix[root, g.rank]))
                    for root, _, buf in rounds if matrix[root, g.rank]]
        if len(received) > 1:
            output.copy_(mint.cat(received, 0))
        elif received:
            F.copy_(output, received[0])   # a narrow() view: needs compat's copy_ workaround
    return calls, assemble
