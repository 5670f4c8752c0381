"""``torch.distributed``-named collectives on MindSpore, native where the device has the kernel.

On CPU, when every rank of a group runs on one host (the usual msrun job), the collectives go
through a shared-memory segment instead (``shm``: C copies, rank-ordered reductions and
barriers; 15-40x mccl's bandwidth at 64 MiB on the development VM, ``benchmarks/collectives.py``):
``all_reduce`` (sum/avg/max/min/prod of fp32, fp64, bf16, int32, int64), ``all_gather``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_to_all``, ``broadcast``,
``barrier`` and the point-to-point pairs. ``runtime.shm_collectives: false`` (or a group across
hosts, or an fp16 reduction) keeps mccl and the compositions below.

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
all_reduce sum/avg under   list ``all_gather`` + sum in rank order     W x N received (a ring:
``set_deterministic``      (the same bits on every rank)               2(W-1)/W x N)
=========================  ==========================================  ==========================

``all_to_all_v`` is ``all_to_all_single`` for callers that already hold every rank's split sizes.
``async_op=True`` of the CPU all-to-all runs the ``scatter`` kernels on one communication thread
(MindSpore's CPU collectives block the calling thread even when asked to be asynchronous); every
buffer is made and read on the caller's thread, and any other collective first waits for that
thread's queue, so all ranks issue collectives in one order (``runtime.comm_thread: false``: inline).

On Ascend (hccl) every op is the native ``mindspore.mint.distributed`` call. In a single process
(no msrun) every group has size 1 and every op is a local no-op/copy, so parallel code paths run
unchanged in unit tests.

Modules, lowest first: ``groups`` (ranks and groups), ``watchdog`` (hung-collective exit),
``work`` (the ``Work`` handle), ``comm_thread`` (the CPU communication thread), ``backend``
(the watched ``mint.distributed`` access point), ``shm`` (the one-host shared-memory channels),
``cpu_compose`` (the CPU compositions above),
``collectives`` and ``p2p`` (the public ops).
"""
from .collectives import (all_gather, all_gather_into_tensor, all_gather_object, all_reduce, all_to_all_single,
                          all_to_all_v, barrier, broadcast, exchange_split_sizes,
                          is_deterministic, reduce_scatter_tensor, set_deterministic)
from .groups import (ProcessGroup, get_rank, get_world_size, mark_initialized, new_group,
                     world_group)
from .p2p import P2POp, batch_isend_irecv, irecv, isend, open_pairs, recv, send
from .watchdog import set_collective_timeout
from .work import Work

__all__ = [
    "ProcessGroup", "Work", "P2POp", "mark_initialized", "get_rank", "get_world_size",
    "world_group", "new_group", "set_collective_timeout", "all_reduce", "all_gather",
    "all_gather_object",
    "all_gather_into_tensor", "reduce_scatter_tensor", "exchange_split_sizes",
    "all_to_all_single", "all_to_all_v", "broadcast", "barrier", "send", "recv", "isend",
    "irecv", "batch_isend_irecv", "open_pairs", "set_deterministic", "is_deterministic",
]
