"""Point-to-point: ``send``/``recv`` and torch's batched ``isend``/``irecv``.

On CPU, MindSpore 2.10's ``send``/``recv`` fail ("The group hccl_world_group does not exist": its
point-to-point kernels look up a rank cache bound to the HCCL world-group name), so a transfer is
a ``broadcast`` in the two-rank group of sender and receiver, which moves the same bytes. The
batched form runs the transfers one after another in an order every rank derives alike, so any
matching set of sends and receives completes without deadlock.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

from mindspore import Tensor

from ms_llm.compat import F, is_cpu
from ms_llm.compat.environment import setting

from .backend import dist, log_once
from .collectives import broadcast, broadcast_call
from . import shm
from .comm_thread import submit
from .groups import ProcessGroup, get_rank, new_group
from .work import Work


def _pair(a: int, b: int) -> ProcessGroup:
    """The two-rank group of ``a`` and ``b``; its shared-memory channel (if any) is set up with
    it, at the same point on both ranks and never on the communication thread."""
    if a == b:
        raise ValueError(f"send/recv: peer is this rank ({a})")
    group = new_group([a, b])
    if is_cpu():
        shm.channel(group)
    return group


def open_pairs(peers: Sequence[int]) -> None:
    """Create this rank's two-rank groups with ``peers`` now, in ascending pair order (every
    member derives it alike), so none is created while the communication thread transfers."""
    if is_cpu():
        me = get_rank()
        for lo, hi in sorted({(min(me, p), max(me, p)) for p in peers if p != me}):
            _pair(lo, hi)


def send(tensor: Tensor, dst: int, group: Optional[ProcessGroup] = None) -> None:
    """Blocking send to global rank ``dst`` (CPU: a broadcast in the two-rank group, because
    MindSpore 2.10's send/recv look up the HCCL world group on CPU and fail)."""
    log_once("send", "broadcast in a two-rank group" if is_cpu() else "native kernel")
    if not is_cpu():
        dist().send(tensor, dst=dst, group=None if group is None else group.name)
        return
    broadcast(F.clone(tensor), src=get_rank(), group=_pair(get_rank(), dst))


def recv(tensor: Tensor, src: int, group: Optional[ProcessGroup] = None) -> None:
    """Blocking receive into ``tensor`` from global rank ``src``."""
    if not is_cpu():
        dist().recv(tensor, src=src, group=None if group is None else group.name)
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
    before the higher rank's), so any set of matching sends/recvs completes without deadlock.

    On CPU the transfers run on the communication thread (``comm_thread``; inline with
    ``runtime.comm_thread: false``) and the returned handles join it, so the caller computes
    while they move, as torch's asynchronous batch does: send tensors are copied now (the caller
    may reuse them), receive buffers are filled by ``wait()``."""
    me = get_rank()
    by_pair = {}
    for i, p in enumerate(p2p_ops):
        by_pair.setdefault((min(me, p.peer), max(me, p.peer)), []).append((i, p))
    if not is_cpu():
        for lo, hi in sorted(by_pair):
            for sender in (lo, hi):
                for _, p in by_pair[(lo, hi)]:
                    if p.kind == "isend" and sender == me:
                        send(p.tensor, p.peer, p.group)
                    elif p.kind == "irecv" and sender == p.peer:
                        recv(p.tensor, p.peer, p.group)
        return [Work() for _ in p2p_ops]
    log_once("batch_isend_irecv", "broadcasts in two-rank groups on the communication thread"
             if setting("runtime.comm_thread") else "broadcasts in two-rank groups, inline")
    # One call per transfer, with its groups, copies and (shared memory) addresses made on this
    # thread; a receive into a non-contiguous tensor lands in a contiguous buffer copied back.
    steps, backs, keep = [], [], []
    for lo, hi in sorted(by_pair):
        group = _pair(lo, hi)
        for sender in (lo, hi):
            for _, p in by_pair[(lo, hi)]:
                if p.kind == "isend" and sender == me:
                    tensor, src = F.clone(p.tensor), me
                elif p.kind == "irecv" and sender == p.peer:
                    tensor, src = p.tensor, p.peer
                    if not tensor.is_contiguous():
                        tensor = tensor.contiguous()
                        backs.append((p.tensor, tensor))
                else:
                    continue
                keep.append(tensor)
                steps.append(broadcast_call(tensor, src, group)
                             or (lambda t=tensor, s=src, g=group: broadcast(t, src=s, group=g)))

    def calls():
        for call in steps:
            call()

    def copy_back():
        for dst, buf in backs:
            F.copy_(dst, buf)
        keep.clear()
    if not steps:
        return [Work() for _ in p2p_ops]
    if not setting("runtime.comm_thread"):
        calls()
        copy_back()
        return [Work() for _ in p2p_ops]
    work = submit(calls, then=copy_back)
    return [work for _ in p2p_ops]
