"""Shared-memory collectives for the ranks of a group that run on one host (CPU backend).

Why: MindSpore 2.10's CPU collectives (mccl, TCP) move 0.1-0.2 GB/s on the development VMs
(``benchmarks/collectives.py``: a 64 MiB ``all_reduce`` ~1 s, torch's gloo ~66 ms), so on CPU
every layout that communicates (data parallel, FSDP, the distributed optimizer, tensor, context
and pipeline parallel, Muon's exchanges) spent most of its step moving bytes. Workers of one job
on one host can copy through memory they share instead.

A ``Channel`` per process group holds one segment in ``/dev/shm`` (one slot per rank plus a result
slot, ``SLOT_BYTES`` each), made when the group's first eligible collective runs: rank 0 creates
it (reserved with ``posix_fallocate``, so a full ``/dev/shm`` is an error here and not a SIGBUS
later) under a name it shares through mccl, every member maps it, then rank 0 unlinks the name
(nothing is left behind, even if the job is killed). The copies, reductions and barriers are C
(``shm_comm.cpp`` beside this file, through ctypes, which releases the GIL, so the
communication thread's transfers run beside this thread's Python). Reductions add the ranks in
rank order, so every rank gets the same bits (deterministic mode holds by construction).

Used when: the backend is CPU, ``runtime.shm_collectives`` is on (``MS_LLM_SHM_COLLECTIVES=0``
turns it off), the C kernels build, and every member reports the same host; otherwise the
collectives keep mccl. Ascend never comes here (HCCL).
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import socket
import uuid
from pathlib import Path
from typing import Dict, Optional, Sequence

import numpy as np
from mindspore import Tensor

from ms_llm.compat.environment import setting

from .groups import ProcessGroup
from .objects import all_gather_object

log = logging.getLogger("ms_llm.parallel")

SLOT_BYTES = 4 << 20           # per rank; a larger operation runs in chunks of this
MAX_WORLD = 256
TIMEOUT_S = 3600.0             # a peer that never arrives (the watchdog usually fires first)
_DTYPES = {"Float32": 0, "Float64": 1, "BFloat16": 2, "Int32": 3, "Int64": 4}
_OPS = {"sum": 0, "max": 1, "min": 2, "prod": 3}
_STATE: Dict[str, object] = {"lib": None, "channels": {}}


def _library():
    """The transport's own library (``shm_comm.cpp`` beside this file), built on first use by the
    kernels' build machinery: same cache, key, lock and atomic replace, off with the AOT kernels."""
    from ms_llm.ops.cpu_kernels.build import Library, main_flag_sets
    return Library("shared-memory collectives", "libmsllm_shm_comm.so", "MsLlmShmAbiVersion",
                   lambda: [Path(__file__).resolve().parent / "shm_comm.cpp"], main_flag_sets,
                   fallback_msg="collectives use mccl")


def _lib():
    if _STATE["lib"] is None:
        path = _library().path()
        _STATE["lib"] = False
        if path is not None:
            lib = ctypes.CDLL(str(path))
            try:
                lib.MsLlmShmAbiVersion.restype = ctypes.c_int64
                if lib.MsLlmShmAbiVersion() == 1:
                    _configure(lib)
                    _STATE["lib"] = lib
            except AttributeError:
                pass
    return _STATE["lib"] or None


def _configure(lib) -> None:
    i64, ptr, dbl = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
    head = [ptr, i64, i64, i64, ptr, dbl]
    lib.MsLlmShmDataOffset.restype = i64
    lib.MsLlmShmDataOffset.argtypes = [i64]
    sigs = {"MsLlmShmBarrier": [],
            "MsLlmShmAllReduce": [ptr, ptr, i64, ctypes.c_int, ctypes.c_int],
            "MsLlmShmAllGather": [ptr, ptr, i64],
            "MsLlmShmReduceScatter": [ptr, ptr, i64, ctypes.c_int, ctypes.c_int],
            "MsLlmShmBroadcast": [ptr, i64, i64],
            "MsLlmShmAllToAllV": [ptr, ptr, ptr, ptr, ptr, ptr, i64]}
    for name, tail in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, head + tail


def dtype_code(t: Tensor) -> Optional[int]:
    """The C kernels' code for ``t``'s dtype when they can reduce it (None: mccl reduces it)."""
    return _DTYPES.get(str(t.dtype))


def op_code(op: str) -> Optional[int]:
    return _OPS.get(op)


class Channel:
    """One group's segment and this rank's barrier counter. Methods take raw addresses (taken by
    the caller's thread, which owns the tensors) so they can run on the communication thread."""

    def __init__(self, group: ProcessGroup, mm: mmap.mmap, lib):
        self.group, self._mm, self._lib = group, mm, lib
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        self.seq = ctypes.c_uint64(0)
        self.head = (ctypes.c_void_p(self.base), group.size, group.rank, SLOT_BYTES,
                     ctypes.byref(self.seq), TIMEOUT_S)

    def _check(self, rc: int, what: str) -> None:
        if rc == 1:
            raise RuntimeError(f"shared-memory {what} over ranks {list(self.group.ranks)}: a peer "
                               f"did not arrive within {TIMEOUT_S:.0f} s")
        if rc:
            raise RuntimeError(f"shared-memory {what}: unsupported dtype or op (code {rc})")

    def barrier(self) -> None:
        self._check(self._lib.MsLlmShmBarrier(*self.head), "barrier")

    def all_reduce(self, src: int, dst: int, count: int, dtype: int, op: int) -> None:
        self._check(self._lib.MsLlmShmAllReduce(*self.head, src, dst, count, dtype, op),
                    "all_reduce")

    def all_gather(self, src: int, dsts: Sequence[int], nbytes: int) -> None:
        outs = (ctypes.c_void_p * len(dsts))(*dsts)
        self._check(self._lib.MsLlmShmAllGather(*self.head, src, outs, nbytes), "all_gather")

    def reduce_scatter(self, src: int, dst: int, count: int, dtype: int, op: int) -> None:
        self._check(self._lib.MsLlmShmReduceScatter(*self.head, src, dst, count, dtype, op),
                    "reduce_scatter")

    def broadcast(self, buf: int, nbytes: int, root: int) -> None:
        self._check(self._lib.MsLlmShmBroadcast(*self.head, buf, nbytes, root), "broadcast")

    def all_to_all(self, src: int, send: np.ndarray, dst: int, recv: np.ndarray,
                   matrix_bytes: np.ndarray) -> None:
        """``send`` / ``recv``: bytes to / from each group rank; ``matrix_bytes[i, j]``: bytes
        rank i sends rank j (every rank passes the same matrix: it fixes the round count)."""
        room = SLOT_BYTES // self.group.size
        rounds = int(-(-int(matrix_bytes.max()) // room)) if matrix_bytes.size else 0
        send, recv = np.ascontiguousarray(send, np.int64), np.ascontiguousarray(recv, np.int64)
        send_off = np.concatenate([[0], np.cumsum(send)[:-1]]).astype(np.int64)
        recv_off = np.concatenate([[0], np.cumsum(recv)[:-1]]).astype(np.int64)
        p = ctypes.c_void_p
        self._check(self._lib.MsLlmShmAllToAllV(
            *self.head, src, p(send.ctypes.data), p(send_off.ctypes.data), dst,
            p(recv.ctypes.data), p(recv_off.ctypes.data), rounds), "all_to_all")


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}|{boot}|{os.getuid()}"


def _segment_bytes(world: int, lib) -> int:
    return int(lib.MsLlmShmDataOffset(world)) + (world + 1) * SLOT_BYTES


def _create(path: str, size: int) -> Optional[str]:
    """Rank 0: the segment under ``path``, complete before the name appears. None or the error."""
    tmp = path + ".tmp"
    try:
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
        os.rename(tmp, path)
        return None
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return f"{type(e).__name__}: {e}"


def _map(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def channel(group: ProcessGroup) -> Optional[Channel]:
    """The group's channel, set up at its first call (a collective over the group through mccl:
    every member must call it at the same point, which holds because every member issues the
    same collectives in the same order). None when the group keeps mccl. Call it on the thread
    that owns the group's collective order (not the communication thread)."""
    key = group.ranks
    if key in _STATE["channels"]:
        return _STATE["channels"][key]
    ch = None
    if group.size > 1 and group.size <= MAX_WORLD and setting("runtime.shm_collectives") \
            and _lib() is not None:
        ch = _setup(group)
    _STATE["channels"][key] = ch
    return ch


def _setup(group: ProcessGroup) -> Optional[Channel]:
    lib = _lib()
    size = _segment_bytes(group.size, lib)
    token = uuid.uuid4().hex if group.rank == 0 else ""
    info = [None] * group.size
    all_gather_object(info, (_host_id(), token), group=group)
    if len({h for h, _ in info}) != 1:
        log.info("ms_llm.parallel: ranks %s span hosts: their collectives stay on mccl",
                 list(group.ranks))
        return None
    path = f"/dev/shm/ms_llm_{info[0][1]}"
    err = _create(path, size) if group.rank == 0 else None
    created = [None] * group.size
    all_gather_object(created, err, group=group)
    if created[0] is not None:
        log.warning("ms_llm.parallel: no shared-memory segment for ranks %s (%s): their "
                    "collectives stay on mccl", list(group.ranks), created[0])
        return None
    mm, err = None, None
    try:
        mm = _map(path, size)
    except OSError as e:
        err = f"{type(e).__name__}: {e}"
    mapped = [None] * group.size
    all_gather_object(mapped, err, group=group)
    if group.rank == 0:
        os.unlink(path)
    bad = [e for e in mapped if e is not None]
    if bad:
        log.warning("ms_llm.parallel: ranks %s could not map the shared segment (%s): their "
                    "collectives stay on mccl", list(group.ranks), bad[0])
        return None
    log.info("ms_llm.parallel: ranks %s: collectives through shared memory", list(group.ranks))
    return Channel(group, mm, lib)


def reset() -> None:
    """Forget every channel (tests); the segments are unmapped when nothing refers to them."""
    _STATE["channels"] = {}
