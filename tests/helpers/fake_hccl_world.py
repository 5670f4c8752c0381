"""A fake HCCL world of N ranks: ms-llm's Ascend communication branch run for real, without NPUs.

Each rank is a spawned process with the device faked as Ascend (``fake_ascend``) and
``mindspore.mint.distributed`` replaced by a module holding only the ops of MindSpore 2.10 that
ms-llm's Ascend branch calls (``all_reduce``, ``all_gather``, ``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_to_all_single``, ``broadcast``, ``send``/``recv``,
``isend``/``irecv``) plus ``mindspore.communication.create_group``. A call is bound to the real
function's signature, its arguments are checked as HCCL would take them (Tensors, contiguous,
a dtype HCCL moves, ``group`` a str, integer peers, equal dtypes of input and output), and it is
handed to the ``World`` in the test process, which

- keeps each rank's call sequence (``World.log``);
- completes a collective only when every member of its group is in a collective of that group,
  and fails (``WorldError``) when they are in different ops or pass different shapes, dtypes,
  reduce ops, roots or split sizes -- the cases a real HCCL world hangs on or corrupts;
- matches a ``send`` with the peer's ``recv`` (peer, shape, dtype, tag) in order, and fails on a
  mismatch;
- fails as a deadlock when every rank that has not finished waits and nothing can match (two
  ranks sending to each other, a collective one rank skips, a rank that finished while its peer
  waits);
- computes each result with numpy (sums in rank order) and sends it back into the output tensors.

Every call blocks its rank until it is matched, asynchronous ones included: HCCL runs a rank's
communication in issue order on its stream, so an order that completes here also completes there,
and one that cannot complete here would hang there.
"""
from __future__ import annotations

import importlib
import inspect
import multiprocessing
import threading
import traceback
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

WORLD_GROUP = "hccl_world_group"   # MindSpore's GlobalComm.WORLD_COMM_GROUP on Ascend
# Dtypes ms-llm moves and HCCL supports (HcclDataType: int8/16/32/64, uint8..64, fp16/32/64, bf16).
HCCL_DTYPES = {"Int8", "Int16", "Int32", "Int64", "UInt8", "UInt16", "UInt32", "UInt64",
               "Float16", "Float32", "Float64", "BFloat16"}
REDUCE_OPS = {"sum", "prod", "max", "min", "avg"}
# op -> (tensor arguments read, tensor arguments written)
OPS = {
    "all_reduce": (("tensor",), ("tensor",)),
    "all_gather": (("tensor",), ("tensor_list",)),
    "all_gather_into_tensor": (("input_tensor",), ("output_tensor",)),
    "reduce_scatter_tensor": (("input",), ("output",)),
    "all_to_all_single": (("input",), ("output",)),
    "broadcast": (("tensor",), ("tensor",)),
    "send": (("tensor",), ()), "isend": (("tensor",), ()),
    "recv": ((), ("tensor",)), "irecv": ((), ("tensor",)),
}
P2P_PEER = {"send": "dst", "isend": "dst", "recv": "src", "irecv": "src"}


class WorldError(AssertionError):
    """A call sequence a real HCCL world would hang on (or compute garbage with)."""


# ----------------------------------------------------------------------------- the coordinator
@dataclass
class Call:
    """One rank's call as the world sees it: ``meta`` is everything but the data (compared
    across ranks), ``data`` the input arrays by argument name."""
    rank: int
    op: str
    group: str
    meta: Dict[str, Any]
    data: Dict[str, Any] = field(default_factory=dict)
    local: Dict[str, Any] = field(default_factory=dict)   # per-rank, not compared
    result: Optional[Dict[str, Any]] = None
    done: threading.Event = field(default_factory=threading.Event)

    def describe(self) -> str:
        return f"{self.op}(group={self.group}, {self.meta})"


class World:
    """The ranks' meeting point; ``call`` blocks the calling rank until its call is matched."""

    def __init__(self, size: int):
        self.size = size
        self.groups: Dict[str, Tuple[int, ...]] = {WORLD_GROUP: tuple(range(size))}
        self.pending: Dict[int, Optional[Call]] = {r: None for r in range(size)}
        self.finished: set = set()
        self.log: Dict[int, List[Tuple[str, str, Dict[str, Any]]]] = {r: [] for r in range(size)}
        self.failure: Optional[str] = None
        self._lock = threading.Condition()

    # --- the ranks' side
    def call(self, c: Call) -> Dict[str, Any]:
        with self._lock:
            if self.failure:
                raise WorldError(self.failure)
            assert self.pending[c.rank] is None, f"rank {c.rank} is already waiting"
            if c.op != "create_group" and c.group not in self.groups:
                self._fail(f"rank {c.rank}: {c.op} on group {c.group!r}, which was never created")
            self.pending[c.rank] = c
            self._progress()
            while not c.done.is_set() and not self.failure:
                self._lock.wait(0.5)
            if self.failure:
                raise WorldError(self.failure)
            return c.result

    def finish(self, rank: int) -> None:
        with self._lock:
            self.finished.add(rank)
            self._progress()

    def abort(self, rank: int, why: str) -> None:
        with self._lock:
            self._fail(f"rank {rank} failed: {why}")

    # --- matching
    def _fail(self, why: str) -> None:
        if not self.failure:
            self.failure = why
        self._lock.notify_all()

    def _members(self, c: Call) -> Tuple[int, ...]:
        return tuple(c.meta["ranks"]) if c.op == "create_group" else self.groups[c.group]

    def _progress(self) -> None:
        moved = True
        while moved and not self.failure:
            moved = False
            for c in [p for p in self.pending.values() if p is not None]:
                if self.pending[c.rank] is not c:
                    continue
                ready = self._match_p2p(c) if c.op in P2P_PEER else self._match_collective(c)
                if self.failure:
                    return
                if ready:
                    moved = True
        waiting = [p for p in self.pending.values() if p is not None]
        if waiting and all(self.pending[r] is not None or r in self.finished
                           for r in range(self.size)):
            self._fail("deadlock: " + "; ".join(
                f"rank {r} waits in {self.pending[r].describe()}" if self.pending[r] else
                f"rank {r} has finished" for r in range(self.size)))

    def _complete(self, calls: Sequence[Call], results: Sequence[Dict[str, Any]]) -> None:
        for c, res in zip(calls, results):
            self.log[c.rank].append((c.op, c.group, c.meta))
            c.result = res
            self.pending[c.rank] = None
            c.done.set()
        self._lock.notify_all()

    def _match_collective(self, c: Call) -> bool:
        members = self._members(c)
        if c.rank not in members:
            self._fail(f"rank {c.rank} calls {c.describe()} on a group without it {members}")
            return False
        gone = [m for m in members if m in self.finished]
        if gone:
            self._fail(f"deadlock: rank {c.rank} waits in {c.describe()}, but rank {gone[0]} "
                       f"of the group has finished")
            return False
        calls = [self.pending[m] for m in members]
        if any(o is None or o.op in P2P_PEER or o.group != c.group for o in calls):
            return False                       # a member is elsewhere (deadlock if it stays)
        for o in calls:
            if (o.op, o.meta) != (calls[0].op, calls[0].meta):
                self._fail(f"collective mismatch on group {c.group}: rank {calls[0].rank} "
                           f"calls {calls[0].describe()}, rank {o.rank} calls {o.describe()}")
                return False
        if c.op == "create_group":
            self.groups[c.group] = members
            results = [{} for _ in calls]
        else:
            try:
                results = COMPUTE[c.op](calls)
            except WorldError as e:
                self._fail(str(e))
                return False
        self._complete(calls, results)
        return True

    def _match_p2p(self, c: Call) -> bool:
        if c.op not in ("send", "isend"):
            return False                       # a receive completes with its send
        peer = c.meta["peer"]
        if peer in self.finished:
            self._fail(f"deadlock: rank {c.rank} waits in {c.describe()}, but rank {peer} has "
                       f"finished")
            return False
        o = self.pending[peer]
        if o is None or o.op not in ("recv", "irecv") or o.meta["peer"] != c.rank:
            return False
        keys = ("shape", "dtype", "tag")
        if o.group != c.group or any(o.meta[k] != c.meta[k] for k in keys):
            self._fail(f"send/recv mismatch: rank {c.rank} sends {c.describe()}, rank {peer} "
                       f"receives {o.describe()}")
            return False
        self._complete([c, o], [{}, {"tensor": c.data["tensor"]}])
        return True


def _reduce(arrays: Sequence[np.ndarray], op: str) -> np.ndarray:
    out = arrays[0].copy()
    for a in arrays[1:]:                       # in rank order, like a deterministic reduction
        out = {"sum": np.add, "avg": np.add, "prod": np.multiply, "max": np.maximum,
               "min": np.minimum}[op](out, a)
    return out / len(arrays) if op == "avg" else out


def _all_reduce(calls):
    out = _reduce([c.data["tensor"] for c in calls], calls[0].meta["op"])
    return [{"tensor": out} for _ in calls]


def _all_gather(calls):
    return [{"tensor_list": [o.data["tensor"] for o in calls]} for _ in calls]


def _rows(calls, many: int) -> None:
    """dim 0 of (output, input) against the group size: index ``many`` holds one block per
    rank."""
    o, i = calls[0].meta["rows"]
    if (o, i)[many] != len(calls) * (o, i)[1 - many]:
        raise WorldError(f"{calls[0].op}: output dim 0 {o}, input dim 0 {i} for "
                         f"{len(calls)} ranks")


def _all_gather_into_tensor(calls):
    _rows(calls, 0)
    out = np.concatenate([o.data["input_tensor"] for o in calls], 0)
    return [{"output_tensor": out} for _ in calls]


def _reduce_scatter_tensor(calls):
    _rows(calls, 1)
    full = _reduce([c.data["input"] for c in calls], calls[0].meta["op"])
    return [{"output": part} for part in np.split(full, len(calls), 0)]


def _all_to_all_single(calls):
    """Rank i's input split j must be rank j's output split i (else HCCL reads past a buffer)."""
    ins = [c.local["splits"][0] for c in calls]
    for j, c in enumerate(calls):
        sent = [ins[i][j] for i in range(len(calls))]
        if list(c.local["splits"][1]) != sent:
            raise WorldError(f"all_to_all_single mismatch: rank {c.rank} expects "
                             f"{list(c.local['splits'][1])} rows, the peers send {sent}")
    chunks = [np.split(c.data["input"], np.cumsum(ins[i])[:-1], 0) for i, c in enumerate(calls)]
    return [{"output": np.concatenate([chunks[i][j] for i in range(len(calls))], 0)}
            for j in range(len(calls))]


def _broadcast(calls):
    src = calls[0].meta["src"]
    root = [c for c in calls if c.rank == src][0]
    return [{"tensor": root.data["tensor"]} for _ in calls]


COMPUTE = {"all_reduce": _all_reduce, "all_gather": _all_gather,
           "all_gather_into_tensor": _all_gather_into_tensor,
           "reduce_scatter_tensor": _reduce_scatter_tensor,
           "all_to_all_single": _all_to_all_single, "broadcast": _broadcast}


# ------------------------------------------------------------------------------ the rank's side
def _dtype_name(t) -> str:
    return str(t.dtype)


def _check_tensor(op: str, name: str, t) -> None:
    from mindspore import Tensor
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: {name} is {type(t).__name__}, not a Tensor")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} is not contiguous (HCCL reads and writes flat memory)")
    if _dtype_name(t) not in HCCL_DTYPES:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}, which HCCL does not move")


def _to_numpy(t) -> np.ndarray:
    from ms_llm.compat import bfloat16, float32
    return (t.astype(float32) if t.dtype == bfloat16 else t).asnumpy()


def _layout(t) -> Tuple[Tuple[int, ...], str]:
    return tuple(int(d) for d in t.shape), _dtype_name(t)


class FakeDistributed:
    """The worker's ``mindspore.mint.distributed``: each op bound to the real signature, checked,
    and completed by the ``World`` through ``send_call`` (``Call`` -> result)."""

    def __init__(self, rank: int, send_call: Callable[[Call], Dict[str, Any]]):
        import mindspore.mint.distributed as real
        self.rank, self._send = rank, send_call
        self.module = types.ModuleType("mindspore.mint.distributed (fake HCCL world)")
        for op in OPS:
            setattr(self.module, op, self._op(op, inspect.signature(getattr(real, op))))

    def create_group(self, group: str, rank_ids: Sequence[int], options=None) -> None:
        if not isinstance(group, str) or not all(isinstance(r, int) for r in rank_ids):
            raise TypeError(f"create_group: group {group!r} must be a str, ranks ints")
        self._send(Call(self.rank, "create_group", group, {"ranks": sorted(rank_ids)}))

    def _op(self, op: str, sig: inspect.Signature):
        reads, writes = OPS[op]

        def call(*args, **kwargs):
            a = sig.bind(*args, **kwargs)
            a.apply_defaults()
            a = dict(a.arguments)
            group = WORLD_GROUP if a["group"] is None else a["group"]
            if not isinstance(group, str):
                raise TypeError(f"{op}: group must be a str, got {type(group).__name__}")
            if "async_op" in a and not isinstance(a["async_op"], bool):
                raise TypeError(f"{op}: async_op must be a bool")
            meta, local = self._meta(op, a)
            for name in reads + writes:
                for t in (a[name] if isinstance(a[name], (list, tuple)) else [a[name]]):
                    _check_tensor(op, name, t)
            data = {name: _to_numpy(a[name]) for name in reads}
            result = self._send(Call(self.rank, op, group, meta, data, local))
            self._write(a, writes, result)
            return _Handle() if a.get("async_op") or op in ("isend", "irecv") else None
        call.__name__ = op
        return call

    def _meta(self, op: str, a: Dict[str, Any]) -> Dict[str, Any]:
        """What every rank of the call must agree on (for p2p: what the peer must match)."""
        if op in P2P_PEER:
            peer = a[P2P_PEER[op]]
            if not isinstance(peer, int) or isinstance(peer, bool) or peer == self.rank:
                raise ValueError(f"{op}: {P2P_PEER[op]} must be another rank's int, got {peer!r}")
            shape, dtype = _layout(a["tensor"])
            return {"peer": peer, "shape": shape, "dtype": dtype, "tag": a["tag"]}, {}
        meta: Dict[str, Any] = {}
        local: Dict[str, Any] = {}
        if "op" in a:
            if a["op"] not in REDUCE_OPS:
                raise ValueError(f"{op}: reduce op {a['op']!r} not one of {sorted(REDUCE_OPS)}")
            meta["op"] = a["op"]
        if op == "broadcast":
            if not isinstance(a["src"], int):
                raise TypeError(f"broadcast: src must be an int, got {a['src']!r}")
            meta["src"] = a["src"]
        if op == "all_gather":
            shape, dtype = _layout(a["tensor"])
            if any(_layout(t) != (shape, dtype) for t in a["tensor_list"]):
                raise ValueError("all_gather: every tensor_list entry must have the input's "
                                 "shape and dtype")
            meta.update(shape=shape, dtype=dtype, outputs=len(a["tensor_list"]))
        elif op == "all_reduce" or op == "broadcast":
            meta["shape"], meta["dtype"] = _layout(a["tensor"])
        elif op in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
            out, inp = (("output_tensor", "input_tensor") if op == "all_gather_into_tensor"
                        else ("output", "input"))
            (so, do), (si, di) = _layout(a[out]), _layout(a[inp])
            if do != di or so[1:] != si[1:]:
                raise ValueError(f"{op}: output {so} {do} and input {si} {di} differ beyond "
                                 f"dim 0")
            meta["row"], meta["dtype"] = si[1:], di
            if op == "all_to_all_single":
                ins, outs = a["input_split_sizes"], a["output_split_sizes"]
                if ins is None or outs is None:
                    raise ValueError("all_to_all_single: ms-llm passes both split lists")
                if sum(ins) != si[0] or sum(outs) != so[0]:
                    raise ValueError(f"all_to_all_single: splits {ins} / {outs} do not sum to "
                                     f"dim 0 of input {si[0]} / output {so[0]}")
                local["splits"] = (tuple(int(v) for v in ins), tuple(int(v) for v in outs))
            else:
                meta["rows"] = (so[0], si[0])
        return meta, local

    def _write(self, a: Dict[str, Any], writes, result: Dict[str, Any]) -> None:
        from mindspore import Tensor
        from ms_llm.compat import F
        for name in writes:
            outs, values = a[name], result[name]
            if not isinstance(outs, (list, tuple)):
                outs, values = [outs], [values]
            if len(outs) != len(values):
                raise WorldError(f"{name}: {len(outs)} output tensors for {len(values)} ranks")
            for out, value in zip(outs, values):
                if tuple(value.shape) != tuple(out.shape):
                    raise WorldError(f"{name}: the result has shape {value.shape}, the output "
                                     f"{tuple(out.shape)}")
                F.copy_(out, Tensor(value).astype(out.dtype))


class _Handle:
    """MindSpore's CommHandle: the work is complete once the World answered."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def install(monkeypatch, rank: int, size: int, send_call: Callable[[Call], Dict[str, Any]]):
    """Make this process rank ``rank`` of ``size`` on the fake Ascend device, its
    ``mint.distributed`` the fake one; returns ``fake_ascend``'s ``(calls, paths)``."""
    import sys
    import mindspore.communication
    import mindspore.mint
    from ms_llm.compat import setup_device
    from ms_llm.parallel import comm
    from .fake_ascend import fake_ascend
    setup_device("CPU")   # what MindSpore really runs on: one kernel thread, synchronous ops
    calls, paths = fake_ascend(monkeypatch)
    fake = FakeDistributed(rank, send_call)
    monkeypatch.setitem(sys.modules, "mindspore.mint.distributed", fake.module)
    monkeypatch.setattr(mindspore.mint, "distributed", fake.module)
    monkeypatch.setattr(mindspore.communication, "create_group", fake.create_group)
    comm.mark_initialized(rank, size)
    return calls, paths


# ----------------------------------------------------------------------------- the processes
def _worker(rank: int, size: int, conn, target: str, args: tuple) -> None:
    """A spawned rank: fake device and world, then ``target`` ("module:function", called as
    ``function(rank, *args)``); its return value goes back to the test."""
    import os
    import pytest
    try:
        def send_call(c: Call) -> Dict[str, Any]:
            conn.send(("call", c.op, c.group, c.meta, c.data, c.local))
            kind, payload = conn.recv()
            if kind == "fail":
                raise WorldError(payload)
            return payload
        with pytest.MonkeyPatch.context() as mp:
            install(mp, rank, size, send_call)
            module, _, fn = target.partition(":")
            out = getattr(importlib.import_module(module), fn)(rank, *args)
        conn.send(("done", out))
    except BaseException:   # noqa: BLE001 - reported to the test, which fails with it
        conn.send(("error", traceback.format_exc()))
    conn.close()
    os._exit(0)   # skip MindSpore's slow interpreter teardown


def _serve(world: World, rank: int, conn, results: dict) -> None:
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            world.abort(rank, "the process exited without reporting")
            return
        if msg[0] == "done":
            results[rank] = msg[1]
            world.finish(rank)
            return
        if msg[0] == "error":
            world.abort(rank, msg[1])
            return
        _, op, group, meta, data, local = msg
        try:
            conn.send(("ok", world.call(Call(rank, op, group, meta, data, local))))
        except WorldError as e:
            conn.send(("fail", str(e)))
        except Exception as e:   # noqa: BLE001 - a bug in a compute function: fail the world
            world.abort(rank, f"the world could not complete {op}: {e!r}")
            conn.send(("fail", world.failure))


def run_world(target: str, size: int = 2, args: tuple = (), timeout: float = 120.0):
    """Run ``target`` on ``size`` spawned ranks through one ``World``; returns ``(results by rank,
    world)``. Raises ``WorldError`` with the first failure (a mismatch, a deadlock, a rank's
    traceback)."""
    ctx = multiprocessing.get_context("spawn")
    world, results, procs, threads = World(size), {}, [], []
    for rank in range(size):
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(rank, size, theirs, target, args), daemon=True)
        p.start()
        theirs.close()
        t = threading.Thread(target=_serve, args=(world, rank, mine, results), daemon=True)
        t.start()
        procs.append(p)
        threads.append(t)
    for t in threads:
        t.join(timeout)
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    if world.failure:
        raise WorldError(world.failure)
    if len(results) != size:
        raise WorldError(f"ranks {sorted(set(range(size)) - set(results))} did not finish "
                         f"within {timeout} s")
    return results, world
