"""``torch.distributed``-named collectives on MindSpore, native where the device has the kernel.

MindSpore 2.10's CPU backend (mccl) registers ``all_reduce``, list ``all_gather``, ``broadcast``,
``gather`` and ``scatter`` only. The rest is composed here, each with the least traffic the available
kernels allow (the choice is logged once per op):

=========================  ==========================================  ==========================
op                         CPU composition                             traffic vs a native kernel
=========================  ==========================================  ==========================
all_gather_into_tensor     list ``all_gather`` + ``cat``               same
reduce_scatter_tensor      one ``scatter`` rooted at each rank (its    same ((W-1)/W x N sent;
                           slice j to rank j), then a local combine    the all_reduce + narrow
                           in rank order                               form sends 2x, measured
                                                                       1.2-2.2x slower)
all_to_all_single          one ``scatter`` rooted at each rank, rows   same (+ row padding to
                           padded to that root's largest split         the root's largest split)
send / recv                ``broadcast`` in a two-rank group           same
barrier                    ``all_reduce`` of one element               -
=========================  ==========================================  ==========================

``all_to_all_v`` is ``all_to_all_single`` for callers that already hold every rank's split sizes.
``async_op=True`` of the CPU all-to-all runs the ``scatter`` kernels on one communication thread
(MindSpore's CPU collectives block the calling thread even when asked to be asynchronous); every
buffer is made and read on the caller's thread, and any other collective first waits for that
thread's queue, so all ranks issue collectives in one order (``MS_LLM_COMM_THREAD=0``: inline).

On Ascend (hccl) every op is the native ``mindspore.mint.distributed`` call. In a single process
(no msrun) every group has size 1 and every op is a local no-op/copy, so parallel code paths run
unchanged in unit tests.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import mindspore as ms
from mindspore import Tensor, mint

from ms_llm.compat import F, is_cpu

log = logging.getLogger("ms_llm.parallel")
_LOGGED: set = set()
_STATE = {"initialized": False, "rank": 0, "world": 1, "world_group": None, "groups": {}}


def _log_once(op: str, how: str) -> None:
    if op not in _LOGGED:
        _LOGGED.add(op)
        log.info("ms_llm.parallel.%s: %s", op, how)


class _WatchedDist:
    """``mindspore.mint.distributed`` with every call under the collective watchdog."""

    def __getattr__(self, name):
        import mindspore.mint.distributed as dist
        fn = getattr(dist, name)

        def call(*args, **kwargs):
            _drain_comm_thread()
            with _watched(name):
                return fn(*args, **kwargs)
        return call


_DIST = _WatchedDist()


def _dist():
    return _DIST


# ----------------------------------------------------------------------------- watchdog
_WATCH = {"timeout": None, "op": None, "since": None, "thread": None}


def set_collective_timeout(seconds: Optional[float]) -> None:
    """Abort this process (exit code 124) when one collective blocks longer than ``seconds``.

    msrun notices a worker that exits or dies (its cluster time-out), but not a live worker stuck
    in a collective its peers never join (mismatched calls, a peer stuck elsewhere). This watchdog
    turns such a hang into an exit, which msrun then propagates to the whole job."""
    _WATCH["timeout"] = seconds
    if seconds and _WATCH["thread"] is None:
        t = threading.Thread(target=_watchdog, name="ms_llm-collective-watchdog", daemon=True)
        _WATCH["thread"] = t
        t.start()


def _watchdog() -> None:
    while True:
        time.sleep(min(5.0, max(0.5, (_WATCH["timeout"] or 5.0) / 4)))
        since, limit = _WATCH["since"], _WATCH["timeout"]
        if since is not None and limit and time.time() - since > limit:
            sys.stderr.write(f"ms_llm: rank {_STATE['rank']}: collective {_WATCH['op']} did not "
                             f"complete within {limit:.0f} s (parallel.collective_timeout_s); "
                             f"aborting\n")
            sys.stderr.flush()
            os._exit(124)


@contextlib.contextmanager
def _watched(op: str):
    if not _WATCH["timeout"] or _WATCH["since"] is not None:
        yield
        return
    _WATCH["op"], _WATCH["since"] = op, time.time()
    try:
        yield
    finally:
        _WATCH["since"] = None


# ----------------------------------------------------------------------------- groups
@dataclass(frozen=True)
class ProcessGroup:
    """A set of global ranks. ``name`` is MindSpore's group name (None when this process is not a
    member, like torch's ``GroupMember.NON_GROUP_MEMBER``)."""
    ranks: Tuple[int, ...]
    name: Optional[str] = field(default=None, compare=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This process's index in the group (-1 when not a member)."""
        me = _STATE["rank"]
        return self.ranks.index(me) if me in self.ranks else -1

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]


def mark_initialized(rank: int, world_size: int) -> None:
    """Called by ``ms_llm.parallel.runtime.init_distributed`` after ``mindspore...init()``."""
    from mindspore.communication import GlobalComm
    _STATE.update(initialized=True, rank=rank, world=world_size)
    _STATE["world_group"] = ProcessGroup(tuple(range(world_size)), GlobalComm.WORLD_COMM_GROUP)


def get_rank() -> int:
    return _STATE["rank"]


def get_world_size() -> int:
    return _STATE["world"]


def world_group() -> ProcessGroup:
    if _STATE["world_group"] is None:
        _STATE["world_group"] = ProcessGroup((0,), None)
    return _STATE["world_group"]


def new_group(ranks: Sequence[int]) -> ProcessGroup:
    """Create a group. Only member ranks take part (MindSpore's CPU backend errors or hangs when
    non-members call the creation, unlike torch); non-members get a non-member handle."""
    ranks = tuple(sorted(int(r) for r in ranks))
    if len(set(ranks)) != len(ranks) or any(r < 0 or r >= get_world_size() for r in ranks):
        raise ValueError(f"new_group: invalid ranks {list(ranks)} for world size {get_world_size()}")
    if ranks == world_group().ranks:
        return world_group()
    if ranks in _STATE["groups"]:
        return _STATE["groups"][ranks]
    if get_rank() not in ranks:
        return ProcessGroup(ranks, None)
    name = "msllm_" + "_".join(map(str, ranks))
    if len(ranks) > 1:
        from mindspore.communication import create_group
        create_group(name, list(ranks))
    group = ProcessGroup(ranks, name)
    _STATE["groups"][ranks] = group
    return group


def _group(group: Optional[ProcessGroup]) -> ProcessGroup:
    g = world_group() if group is None else group
    if g.rank < 0:
        raise RuntimeError(f"rank {get_rank()} is not a member of group {list(g.ranks)}")
    return g


# ----------------------------------------------------------------------------- work handles
class Work:
    """Handle of a possibly asynchronous collective; ``wait()`` blocks and finishes it."""

    def __init__(self, handles: Sequence = (), then: Optional[Callable[[], None]] = None):
        self._handles, self._then, self._done = list(handles), then, False
        self.timing: Optional[Tuple[float, float]] = None   # known for thread-run collectives

    def wait(self) -> bool:
        if not self._done:
            with _watched("wait"):
                for h in self._handles:
                    if h is not None:
                        h.wait()
            if self._then is not None:
                self._then()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done


def _finish(work: Work, async_op: bool) -> Optional[Work]:
    if async_op:
        return work
    work.wait()
    return None


_OPS = {"sum": "sum", "avg": "avg", "max": "max", "min": "min", "prod": "prod"}


def _op(op: str) -> str:
    key = str(op).lower().split(".")[-1]
    if key not in _OPS:
        raise ValueError(f"unsupported reduce op {op!r}; expected one of {sorted(_OPS)}")
    return _OPS[key]


# ----------------------------------------------------------------------------- collectives
def all_reduce(tensor: Tensor, op: str = "sum", group: Optional[ProcessGroup] = None,
               async_op: bool = False) -> Optional[Work]:
    """In place, like torch. ``avg`` is sum then divide (mccl's avg is not used for bf16 safety)."""
    g = _group(group)
    if g.size == 1:
        return _finish(Work(), async_op)
    op = _op(op)
    if op == "avg":
        h = _dist().all_reduce(tensor, op="sum", group=g.name, async_op=async_op)
        return _finish(Work([h] if async_op else [], lambda: tensor.copy_(tensor / g.size)),
                       async_op)
    h = _dist().all_reduce(tensor, op=op, group=g.name, async_op=async_op)
    return _finish(Work([h] if async_op else []), async_op)


def all_gather(tensor_list: List[Tensor], tensor: Tensor, group: Optional[ProcessGroup] = None,
               async_op: bool = False) -> Optional[Work]:
    g = _group(group)
    if g.size == 1:
        F.copy_(tensor_list[0], tensor)
        return _finish(Work(), async_op)
    h = _dist().all_gather(tensor_list, tensor, group=g.name, async_op=async_op)
    return _finish(Work([h] if async_op else []), async_op)


def all_gather_into_tensor(output: Tensor, input: Tensor, group: Optional[ProcessGroup] = None,
                           async_op: bool = False) -> Optional[Work]:
    """``output`` (dim 0 = size x input's dim 0) receives every rank's ``input`` in rank order."""
    g = _group(group)
    if output.shape[0] != input.shape[0] * g.size:
        raise ValueError(f"all_gather_into_tensor: output dim 0 is {output.shape[0]}, expected "
                         f"{input.shape[0]} x {g.size}")
    if g.size == 1:
        F.copy_(output, input)
        return _finish(Work(), async_op)
    if not is_cpu():
        _log_once("all_gather_into_tensor", "native kernel")
        h = _dist().all_gather_into_tensor(output, input, group=g.name, async_op=async_op)
        return _finish(Work([h] if async_op else []), async_op)
    _log_once("all_gather_into_tensor", "CPU: list all_gather + cat")
    parts = [mint.zeros(input.shape, dtype=input.dtype) for _ in range(g.size)]
    h = _dist().all_gather(parts, input, group=g.name, async_op=async_op)
    return _finish(Work([h] if async_op else [], lambda: output.copy_(mint.cat(parts, 0))),
                   async_op)


def reduce_scatter_tensor(output: Tensor, input: Tensor, op: str = "sum",
                          group: Optional[ProcessGroup] = None,
                          async_op: bool = False) -> Optional[Work]:
    """``output`` receives this rank's dim-0 slice of the reduction of every rank's ``input``."""
    g = _group(group)
    if input.shape[0] != output.shape[0] * g.size:
        raise ValueError(f"reduce_scatter_tensor: input dim 0 is {input.shape[0]}, expected "
                         f"{output.shape[0]} x {g.size}")
    if g.size == 1:
        F.copy_(output, input)
        return _finish(Work(), async_op)
    op = _op(op)
    if not is_cpu():
        _log_once("reduce_scatter_tensor", "native kernel")
        h = _dist().reduce_scatter_tensor(output, input, op=op, group=g.name, async_op=async_op)
        return _finish(Work([h] if async_op else []), async_op)
    if _CPU_REDUCE_SCATTER == "scatter":
        _log_once("reduce_scatter_tensor", "CPU: one scatter per root + local combine")
        return _reduce_scatter_by_scatter(output, input, op, g, async_op)
    _log_once("reduce_scatter_tensor", "CPU: all_reduce on a copy + narrow (2x traffic)")
    return _reduce_scatter_by_all_reduce(output, input, op, g, async_op)


# The CPU composition reduce_scatter_tensor uses; benchmarks/collectives.py measures both.
_CPU_REDUCE_SCATTER = "scatter"


def _reduce_scatter_by_all_reduce(output: Tensor, input: Tensor, op: str, g: ProcessGroup,
                                  async_op: bool) -> Optional[Work]:
    """All-reduce a copy of the whole input, keep this rank's slice (2(W-1)/W x N bytes sent)."""
    buf = F.clone(input)
    n = output.shape[0]
    h = _dist().all_reduce(buf, op="sum" if op == "avg" else op, group=g.name, async_op=async_op)

    def then():
        piece = mint.narrow(buf, 0, g.rank * n, n)
        F.copy_(output, piece / g.size if op == "avg" else piece)
    return _finish(Work([h] if async_op else [], then), async_op)


_COMBINE = {"sum": lambda a, b: a + b, "avg": lambda a, b: a + b, "prod": lambda a, b: a * b,
            "max": lambda a, b: mint.maximum(a, b), "min": lambda a, b: mint.minimum(a, b)}


def _reduce_scatter_by_scatter(output: Tensor, input: Tensor, op: str, g: ProcessGroup,
                               async_op: bool) -> Optional[Work]:
    """Rank j's slice of every rank's input reaches rank j through one ``scatter`` rooted at each
    rank (W calls; the slices are views, not copies); rank j then combines the W slices in rank
    order. Each rank sends (W-1)/W x N bytes, what a native reduce-scatter moves."""
    n, w = output.shape[0], g.size
    chunks = [mint.narrow(input, 0, j * n, n) for j in range(w)]
    bufs, handles = [], []
    for root in range(w):
        buf = mint.zeros(output.shape, dtype=output.dtype)
        bufs.append(buf)
        handles.append(_dist().scatter(buf, chunks if root == g.rank else [],
                                       src=g.global_rank(root), group=g.name, async_op=async_op))

    def then():
        acc = bufs[0]
        for b in bufs[1:]:
            acc = _COMBINE[op](acc, b)
        F.copy_(output, acc / w if op == "avg" else acc)
    return _finish(Work(handles if async_op else [], then), async_op)


def exchange_split_sizes(splits: Sequence[int], group: Optional[ProcessGroup] = None
                         ) -> np.ndarray:
    """Every rank's split sizes (or any integer vector of one length, e.g. per-expert counts),
    gathered: row i = group rank i's vector (one ``all_gather``)."""
    g = _group(group)
    if g.size == 1:
        return np.asarray([list(splits)], np.int64)
    mine = Tensor(np.asarray(splits, np.int32))
    rows = [Tensor(np.zeros(len(splits), np.int32)) for _ in range(g.size)]
    _dist().all_gather(rows, mine, group=g.name)
    return np.stack([r.asnumpy() for r in rows]).astype(np.int64)


def all_to_all_single(output: Tensor, input: Tensor,
                      output_split_sizes: Optional[Sequence[int]] = None,
                      input_split_sizes: Optional[Sequence[int]] = None,
                      group: Optional[ProcessGroup] = None,
                      async_op: bool = False) -> Optional[Work]:
    """Rank r sends rows ``input_split_sizes[j]`` to rank j and receives ``output_split_sizes[i]``
    rows from rank i, along dim 0 (even splits when the sizes are None)."""
    g = _group(group)
    w = g.size
    in_splits = list(input_split_sizes) if input_split_sizes is not None else \
        [input.shape[0] // w] * w
    out_splits = list(output_split_sizes) if output_split_sizes is not None else \
        [output.shape[0] // w] * w
    _check_splits(output, input, out_splits, in_splits, w)
    if w == 1:
        F.copy_(output, input)
        return _finish(Work(), async_op)
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
    g = _group(group)
    m = np.asarray(split_matrix, np.int64)
    if m.shape != (g.size, g.size):
        raise ValueError(f"all_to_all_v: split_matrix has shape {m.shape}, expected "
                         f"({g.size}, {g.size})")
    in_splits, out_splits = [int(v) for v in m[g.rank]], [int(v) for v in m[:, g.rank]]
    _check_splits(output, input, out_splits, in_splits, g.size)
    if g.size == 1:
        F.copy_(output, input)
        return _finish(Work(), async_op)
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
    if not is_cpu():
        _log_once("all_to_all_single", "native kernel")
        h = _dist().all_to_all_single(output, input, out_splits, in_splits, group=g.name,
                                      async_op=async_op)
        return _finish(Work([h] if async_op else []), async_op)
    _log_once("all_to_all_single", "CPU: one scatter per root, rows padded to the root's max")
    calls, assemble = _all_to_all_cpu_plan(output, input, in_splits, matrix, g)
    if async_op and os.environ.get("MS_LLM_COMM_THREAD", "1") != "0":
        return _submit(calls, then=assemble)
    calls()
    assemble()
    return _finish(Work(), async_op)


def _all_to_all_cpu_plan(output, input, in_splits, matrix: np.ndarray, g: ProcessGroup):
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
            _dist().scatter(buf, chunks, src=g.global_rank(root), group=g.name)

    def assemble():
        received = [mint.narrow(buf, 0, 0, int(matrix[root, g.rank]))
                    for root, _, buf in rounds if matrix[root, g.rank]]
        if len(received) > 1:
            output.copy_(mint.cat(received, 0))
        elif received:
            F.copy_(output, received[0])   # a narrow() view: needs compat's copy_ workaround
    return calls, assemble


# ----------------------------------------------------------------------------- comm thread
_COMM = {"executor": None, "pending": [], "local": threading.local()}


class _ThreadWork(Work):
    """A collective running on the communication thread; ``wait()`` joins it (and re-raises
    its error in the caller)."""

    def __init__(self, future, then: Optional[Callable[[], None]] = None):
        super().__init__(then=then)
        self._future = future
        self.timing: Optional[Tuple[float, float]] = None   # perf_counter start/end on the thread

    def wait(self) -> bool:
        if not self._done:
            with _watched("wait"):
                self.timing = self._future.result()
            if self._then is not None:
                self._then()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done or self._future.done()


def _submit(fn: Callable[[], None], then: Optional[Callable[[], None]] = None) -> Work:
    """Run the collective kernels ``fn`` on the communication thread; ``then`` runs on the
    caller's thread in ``wait()``. Only kernel launches cross threads: buffers are made and read
    by the caller (MindSpore's PyNative executor is not safe for concurrent tensor ops)."""
    if _COMM["executor"] is None:
        from concurrent.futures import ThreadPoolExecutor

        def mark():
            _COMM["local"].comm_thread = True
        _COMM["executor"] = ThreadPoolExecutor(1, thread_name_prefix="ms_llm-comm",
                                               initializer=mark)

    def timed():
        t0 = time.perf_counter()
        fn()
        return t0, time.perf_counter()
    fut = _COMM["executor"].submit(timed)
    _COMM["pending"] = [f for f in _COMM["pending"] if not f.done()] + [fut]
    return _ThreadWork(fut, then)


def _drain_comm_thread() -> None:
    """Called before any collective on a non-communication thread: finish queued ones first."""
    if _COMM["pending"] and not getattr(_COMM["local"], "comm_thread", False):
        pending, _COMM["pending"] = _COMM["pending"], []
        for fut in pending:
            fut.result()


def broadcast(tensor: Tensor, src: int, group: Optional[ProcessGroup] = None,
              async_op: bool = False) -> Optional[Work]:
    """``src`` is a global rank, as in torch."""
    g = _group(group)
    if src not in g.ranks:
        raise ValueError(f"broadcast: src {src} is not in group {list(g.ranks)}")
    if g.size == 1:
        return _finish(Work(), async_op)
    h = _dist().broadcast(tensor, src=src, group=g.name, async_op=async_op)
    return _finish(Work([h] if async_op else []), async_op)


def barrier(group: Optional[ProcessGroup] = None) -> None:
    # An all-reduce, not mccl's barrier: the notes saw one sync barrier variant misbehave.
    g = _group(group)
    if g.size > 1:
        t = mint.ones((1,), dtype=ms.float32)
        _dist().all_reduce(t, group=g.name)
        float(t.asnumpy()[0])


# ----------------------------------------------------------------------------- point to point
def _pair(a: int, b: int) -> ProcessGroup:
    if a == b:
        raise ValueError(f"send/recv: peer is this rank ({a})")
    return new_group([a, b])


def send(tensor: Tensor, dst: int, group: Optional[ProcessGroup] = None) -> None:
    """Blocking send to global rank ``dst`` (CPU: a broadcast in the two-rank group, because
    MindSpore 2.10's send/recv look up the HCCL world group on CPU and fail)."""
    _log_once("send", "broadcast in a two-rank group" if is_cpu() else "native kernel")
    if not is_cpu():
        _dist().send(tensor, dst=dst, group=None if group is None else group.name)
        return
    broadcast(F.clone(tensor), src=get_rank(), group=_pair(get_rank(), dst))


def recv(tensor: Tensor, src: int, group: Optional[ProcessGroup] = None) -> None:
    """Blocking receive into ``tensor`` from global rank ``src``."""
    if not is_cpu():
        _dist().recv(tensor, src=src, group=None if group is None else group.name)
        return
    broadcast(tensor, src=src, group=_pair(get_rank(), src))


@dataclass
class P2POp:
    """torch.distributed.P2POp: ``op`` is ``isend`` or ``irecv`` (the functions or their names)."""
    op: object
    tensor: Tensor
    peer: int
    group: Optional[ProcessGroup] = None

    @property
    def kind(self) -> str:
        name = self.op if isinstance(self.op, str) else getattr(self.op, "__name__", "")
        if name not in ("isend", "irecv"):
            raise ValueError(f"P2POp: op must be isend or irecv, got {self.op!r}")
        return name


def isend(tensor: Tensor, dst: int, group: Optional[ProcessGroup] = None) -> Work:
    return batch_isend_irecv([P2POp("isend", tensor, dst, group)])[0]


def irecv(tensor: Tensor, src: int, group: Optional[ProcessGroup] = None) -> Work:
    return batch_isend_irecv([P2POp("irecv", tensor, src, group)])[0]


def batch_isend_irecv(p2p_ops: Sequence[P2POp]) -> List[Work]:
    """Run the exchanges in one global order (peer pairs ascending, then the lower rank's sends
    before the higher rank's), so any set of matching sends/recvs completes without deadlock."""
    me = get_rank()
    by_pair = {}
    for i, p in enumerate(p2p_ops):
        by_pair.setdefault((min(me, p.peer), max(me, p.peer)), []).append((i, p))
    for lo, hi in sorted(by_pair):
        ops_ = by_pair[(lo, hi)]
        # Sends from `lo` first, then sends from `hi`; each side orders its ops the same way.
        for sender in (lo, hi):
            for _, p in ops_:
                if p.kind == "isend" and sender == me:
                    send(p.tensor, p.peer, p.group)
                elif p.kind == "irecv" and sender == p.peer:
                    recv(p.tensor, p.peer, p.group)
    return [Work() for _ in p2p_ops]
