"""The collectives, torch.distributed-named: native kernels on Ascend, compositions on CPU.

Each op checks its arguments, makes groups of size 1 a local copy, and then calls the native
``mindspore.mint.distributed`` kernel or, on CPU where mccl has none, the composition in
``cpu_compose``. ``src`` ranks are global ranks and group ranks index ``ProcessGroup.ranks``, as
in torch.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import mindspore as ms
from mindspore import Tensor, mint

from ms_llm.compat import F, is_cpu
from ms_llm.compat.environment import setting

from . import cpu_compose, shm
from .backend import dist, log_once
from .comm_thread import drain, submit
from .groups import ProcessGroup, get_rank, member_group
from .objects import all_gather_object  # noqa: F401 (re-exported)
from .cpu_compose import is_deterministic, set_deterministic  # noqa: F401 (re-exported)
from .watchdog import watched
from .work import Work, finish

_OPS = {"sum": "sum", "avg": "avg", "max": "max", "min": "min", "prod": "prod"}


def _op(op: str) -> str:
    key = str(op).lower().split(".")[-1]
    if key not in _OPS:
        raise ValueError(f"unsupported reduce op {op!r}; expected one of {sorted(_OPS)}")
    return _OPS[key]


def _check_rows(op: str, which: str, rows: int, per_rank: int, size: int) -> None:
    """The full tensor of a gather / scatter holds one ``per_rank``-row block per group rank."""
    if rows != per_rank * size:
        raise ValueError(f"{op}: {which} dim 0 is {rows}, expected {per_rank} x {size}")


# ---------------------------------------------------------------- shared memory (CPU, one host)
def _shm_channel(g: ProcessGroup, dtype_of: Optional[Tensor] = None,
                 op: Optional[str] = None) -> Optional["shm.Channel"]:
    """The group's shared-memory channel when this op can use it (CPU; for a reduction, a dtype
    and op the C kernels reduce). The answer is the same on every member (same call)."""
    if not is_cpu():
        return None
    if dtype_of is not None and (shm.dtype_code(dtype_of) is None
                                 or shm.op_code("sum" if op == "avg" else op) is None):
        return None
    return shm.channel(g)


def _contiguous(t: Tensor) -> Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _numel(t: Tensor) -> int:
    return int(np.prod(t.shape, dtype=np.int64))


def _shm_run(ch: "shm.Channel", name: str, call, async_op: bool, then=None,
             keep: tuple = ()) -> Optional[Work]:
    """Run ``call`` (the channel's C call on addresses taken here, by the tensors' owner) on the
    communication thread when asynchronous, else here after that thread's queue. ``keep``: the
    tensors whose addresses ``call`` uses, referenced until it has run (a temporary input would
    otherwise be freed while the thread still reads it)."""
    log_once(name, "CPU: shared memory (one host)")
    if async_op and setting("runtime.comm_thread"):
        def run():
            call()
            del keep_alive[:]
        keep_alive = list(keep)
        return submit(run, then=then)
    drain()
    with watched(name, ch.group.name):
        call()
    return finish(Work([], then), async_op)


def _shm_outputs(outs: Sequence[Tensor]):
    """Contiguous stand-ins for ``outs`` (the same tensor when already contiguous) and the copy
    back that the op's completion runs."""
    bufs = [o if o.is_contiguous() else o.contiguous() for o in outs]

    def back():
        for o, b in zip(outs, bufs):
            if b is not o:
                F.copy_(o, b)
    return bufs, back


def _then(*steps):
    steps = [s for s in steps if s is not None]
    return (lambda: [s() for s in steps]) if steps else None


def all_reduce(tensor: Tensor, op: str = "sum", group: Optional[ProcessGroup] = None,
               async_op: bool = False) -> Optional[Work]:
    """In place, like torch. ``avg`` is sum then divide (mccl's avg is not used for bf16 safety)."""
    g = member_group(group)
    if g.size == 1:
        return finish(Work(), async_op)
    op = _op(op)
    ch = _shm_channel(g, tensor, op)
    if ch is not None:           # rank-ordered sums: deterministic as well
        (buf,), back = _shm_outputs([tensor])
        n, ptr = _numel(buf), buf.data_ptr() if _numel(buf) else 0
        code, opc = shm.dtype_code(buf), shm.op_code("sum" if op == "avg" else op)
        avg = (lambda: F.copy_(tensor, tensor / g.size)) if op == "avg" else None
        return _shm_run(ch, "all_reduce", lambda: n and ch.all_reduce(ptr, ptr, n, code, opc),
                        async_op, _then(back, avg), keep=(buf,))
    if is_deterministic() and op in ("sum", "avg") and is_cpu():
        return cpu_compose.all_reduce_in_rank_order(tensor, op, g, async_op)
    then = (lambda: tensor.copy_(tensor / g.size)) if op == "avg" else None
    mccl_op = "sum" if op == "avg" else op
    if is_cpu():
        return cpu_compose.issue(
            lambda a: [dist().all_reduce(tensor, op=mccl_op, group=g.name, async_op=a)],
            async_op, then)
    h = dist().all_reduce(tensor, op=mccl_op, group=g.name, async_op=async_op)
    return finish(Work([h] if async_op else [], then), async_op)


def all_gather(tensor_list: List[Tensor], tensor: Tensor, group: Optional[ProcessGroup] = None,
               async_op: bool = False) -> Optional[Work]:
    g = member_group(group)
    if g.size == 1:
        F.copy_(tensor_list[0], tensor)
        return finish(Work(), async_op)
    ch = _shm_channel(g)
    if ch is not None:
        src = _contiguous(tensor)
        bufs, back = _shm_outputs(tensor_list)
        nbytes = int(src.nbytes)
        ptrs = (src.data_ptr(), [b.data_ptr() for b in bufs]) if nbytes else None
        return _shm_run(ch, "all_gather", lambda: ptrs and ch.all_gather(ptrs[0], ptrs[1], nbytes),
                        async_op, back, keep=(src, *bufs))
    if is_cpu():
        return cpu_compose.issue(
            lambda a: [dist().all_gather(tensor_list, tensor, group=g.name, async_op=a)],
            async_op)
    h = dist().all_gather(tensor_list, tensor, group=g.name, async_op=async_op)
    return finish(Work([h] if async_op else []), async_op)


def all_gather_into_tensor(output: Tensor, input: Tensor, group: Optional[ProcessGroup] = None,
                           async_op: bool = False) -> Optional[Work]:
    """``output`` (dim 0 = size x input's dim 0) receives every rank's ``input`` in rank order."""
    g = member_group(group)
    _check_rows("all_gather_into_tensor", "output", output.shape[0], input.shape[0], g.size)
    if g.size == 1:
        F.copy_(output, input)
        return finish(Work(), async_op)
    ch = _shm_channel(g)
    if ch is not None:
        src = _contiguous(input)
        (buf,), back = _shm_outputs([output])
        nbytes = int(src.nbytes)
        ptrs = (src.data_ptr(), [buf.data_ptr() + r * nbytes for r in range(g.size)]) \
            if nbytes else None
        return _shm_run(ch, "all_gather_into_tensor",
                        lambda: ptrs and ch.all_gather(ptrs[0], ptrs[1], nbytes), async_op, back,
                        keep=(src, buf))
    if is_cpu():
        return cpu_compose.all_gather_into_tensor(output, input, g, async_op)
    log_once("all_gather_into_tensor", "native kernel")
    h = dist().all_gather_into_tensor(output, input, group=g.name, async_op=async_op)
    return finish(Work([h] if async_op else []), async_op)


def reduce_scatter_tensor(output: Tensor, input: Tensor, op: str = "sum",
                          group: Optional[ProcessGroup] = None,
                          async_op: bool = False) -> Optional[Work]:
    """``output`` receives this rank's dim-0 slice of the reduction of every rank's ``input``."""
    g = member_group(group)
    _check_rows("reduce_scatter_tensor", "input", input.shape[0], output.shape[0], g.size)
    if g.size == 1:
        F.copy_(output, input)
        return finish(Work(), async_op)
    op = _op(op)
    ch = _shm_channel(g, input, op)
    if ch is not None:
        src = _contiguous(input)
        (buf,), back = _shm_outputs([output])
        n = _numel(buf)
        ptrs = (src.data_ptr(), buf.data_ptr()) if n else None
        code, opc = shm.dtype_code(src), shm.op_code("sum" if op == "avg" else op)
        avg = (lambda: F.copy_(output, output / g.size)) if op == "avg" else None
        return _shm_run(ch, "reduce_scatter_tensor",
                        lambda: ptrs and ch.reduce_scatter(ptrs[0], ptrs[1], n, code, opc),
                        async_op, _then(back, avg), keep=(src, buf))
    if is_cpu():
        return cpu_compose.reduce_scatter_tensor(output, input, op, g, async_op)
    log_once("reduce_scatter_tensor", "native kernel")
    h = dist().reduce_scatter_tensor(output, input, op=op, group=g.name, async_op=async_op)
    return finish(Work([h] if async_op else []), async_op)


def exchange_split_sizes(splits: Sequence[int], group: Optional[ProcessGroup] = None
                         ) -> np.ndarray:
    """Every rank's split sizes (or any integer vector of one length, e.g. per-expert counts),
    gathered: row i = group rank i's vector (one ``all_gather``)."""
    g = member_group(group)
    if g.size == 1:
        return np.asarray([list(splits)], np.int64)
    mine = Tensor(np.asarray(splits, np.int32))
    rows = [Tensor(np.zeros(len(splits), np.int32)) for _ in range(g.size)]
    all_gather(rows, mine, group=g)
    return np.stack([r.asnumpy() for r in rows]).astype(np.int64)


def all_to_all_single(output: Tensor, input: Tensor,
                      output_split_sizes: Optional[Sequence[int]] = None,
                      input_split_sizes: Optional[Sequence[int]] = None,
                      group: Optional[ProcessGroup] = None,
                      async_op: bool = False) -> Optional[Work]:
    """Rank r sends rows ``input_split_sizes[j]`` to rank j and receives ``output_split_sizes[i]``
    rows from rank i, along dim 0 (even splits when the sizes are None)."""
    g = member_group(group)
    w = g.size
    in_splits = list(input_split_sizes) if input_split_sizes is not None else \
        [input.shape[0] // w] * w
    out_splits = list(output_split_sizes) if output_split_sizes is not None else \
        [output.shape[0] // w] * w
    _check_splits(output, input, out_splits, in_splits, w)
    if w == 1:
        F.copy_(output, input)
        return finish(Work(), async_op)
    matrix = exchange_split_sizes(in_splits, g) if is_cpu() else None
    if matrix is not None and [int(v) for v in matrix[:, g.rank]] != out_splits:
        raise ValueError(f"all_to_all_single: output_split_sizes {out_splits} on rank "
                         f"{get_rank()} disagree with what the peers send "
                         f"{matrix[:, g.rank].tolist()}")
    return _all_to_all(output, input, out_splits, in_splits, matrix, g, async_op)


def all_to_all_v(output: Tensor, input: Tensor, split_matrix: np.ndarray,
                 group: Optional[ProcessGroup] = None, async_op: bool = False) -> Optional[Work]:
    """``all_to_all_single`` when every rank already knows the whole ``split_matrix``
    (``[i, j]`` = rows group rank i sends to group rank j), e.g. an expert-parallel dispatcher
    that exchanged its per-expert counts once for several all-to-alls: no size exchange here.

    ``async_op=True`` overlaps the exchange with the caller's compute: native asynchronous
    collectives on Ascend; on CPU the composition runs on one background communication thread
    (MindSpore's CPU collectives block the calling thread even with ``async_op``). Collectives
    issued from the main thread first wait for that thread's queue, so every rank still issues
    its collectives in one order."""
    g = member_group(group)
    m = np.asarray(split_matrix, np.int64)
    if m.shape != (g.size, g.size):
        raise ValueError(f"all_to_all_v: split_matrix has shape {m.shape}, expected "
                         f"({g.size}, {g.size})")
    in_splits, out_splits = [int(v) for v in m[g.rank]], [int(v) for v in m[:, g.rank]]
    _check_splits(output, input, out_splits, in_splits, g.size)
    if g.size == 1:
        F.copy_(output, input)
        return finish(Work(), async_op)
    return _all_to_all(output, input, out_splits, in_splits, m, g, async_op)


def _check_splits(output: Tensor, input: Tensor, out_splits, in_splits, w: int) -> None:
    if sum(in_splits) != input.shape[0] or len(in_splits) != w:
        raise ValueError(f"all_to_all: input_split_sizes {in_splits} do not match input "
                         f"dim 0 ({input.shape[0]}) and group size {w}")
    if sum(out_splits) != output.shape[0] or len(out_splits) != w:
        raise ValueError(f"all_to_all: output_split_sizes {out_splits} do not match "
                         f"output dim 0 ({output.shape[0]}) and group size {w}")


def _all_to_all(output, input, out_splits, in_splits, matrix, g: ProcessGroup,
                async_op: bool) -> Optional[Work]:
    ch = _shm_channel(g)
    if ch is not None:
        src = _contiguous(input)
        (buf,), back = _shm_outputs([output])
        row = int(np.prod(input.shape[1:], dtype=np.int64)) * int(input.itemsize)
        m = np.asarray(matrix, np.int64) * row
        ptrs = (src.data_ptr() if _numel(src) else 0, buf.data_ptr() if _numel(buf) else 0)
        return _shm_run(ch, "all_to_all_single", lambda: ch.all_to_all(
            ptrs[0], m[g.rank], ptrs[1], m[:, g.rank], m), async_op, back, keep=(src, buf))
    if is_cpu():
        return cpu_compose.all_to_all(output, input, in_splits, matrix, g, async_op)
    log_once("all_to_all_single", "native kernel")
    h = dist().all_to_all_single(output, input, out_splits, in_splits, group=g.name,
                                 async_op=async_op)
    return finish(Work([h] if async_op else []), async_op)


def broadcast(tensor: Tensor, src: int, group: Optional[ProcessGroup] = None,
              async_op: bool = False) -> Optional[Work]:
    """``src`` is a global rank, as in torch."""
    g = member_group(group)
    if src not in g.ranks:
        raise ValueError(f"broadcast: src {src} is not in group {list(g.ranks)}")
    if g.size == 1:
        return finish(Work(), async_op)
    if _shm_channel(g) is not None:
        (buf,), back = _shm_outputs([tensor])
        return _shm_run(shm.channel(g), "broadcast", broadcast_call(buf, src, g), async_op, back,
                        keep=(buf,))
    h = dist().broadcast(tensor, src=src, group=g.name, async_op=async_op)
    return finish(Work([h] if async_op else []), async_op)


def broadcast_call(tensor: Tensor, src: int, g: ProcessGroup):
    """The shared-memory broadcast of ``tensor`` (contiguous, owned by the caller, who keeps it
    alive) as a call that may run on the communication thread, or None when the group has no
    shared-memory channel. Addresses are taken here, on the caller's thread."""
    ch = _shm_channel(g)
    if ch is None:
        return None
    if not tensor.is_contiguous():
        raise ValueError("broadcast: a shared-memory broadcast needs a contiguous tensor")
    nbytes, root = int(tensor.nbytes), g.ranks.index(src)
    ptr = tensor.data_ptr() if nbytes else 0
    return lambda: nbytes and ch.broadcast(ptr, nbytes, root)


def barrier(group: Optional[ProcessGroup] = None) -> None:
    """Block until every member arrives: an all-reduce of one element, read back on the host.
    Not mccl's own barrier: on MindSpore 2.10's CPU backend one synchronous variant of it gave a
    wrong result when probed, while all_reduce has been reliable."""
    g = member_group(group)
    ch = _shm_channel(g) if g.size > 1 else None
    if ch is not None:
        _shm_run(ch, "barrier", ch.barrier, False)
    elif g.size > 1:
        t = mint.ones((1,), dtype=ms.float32)
        dist().all_reduce(t, group=g.name)
        float(t.asnumpy()[0])
