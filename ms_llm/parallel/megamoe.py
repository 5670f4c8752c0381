"""MegaMoE: one pipelined expert FFN that overlaps the all-to-alls with the experts' GEMMs.

The local experts are split into ``G`` groups and the tokens into ``C`` chunks; a stage is one
(chunk, group) pair (C x G stages, so a rank with a single local expert still pipelines). Tokens
are permuted so that, for each stage, the rows bound for every ep rank are contiguous; each stage
then has its own (smaller) all-to-all.

Forward, for stage s = 0..CG-1::

    dispatch(s+1) in flight            # all_to_all_v(async_op=True)
    wait dispatch(s); regroup; GEMM1 -> SwiGLU -> GEMM2 for stage s's rows
    combine(s) in flight               # reverse all-to-all, waited at the end

Backward, the same interleaving: the gradient all-to-all of stage s+1 travels while stage s's
activation-gradient GEMMs run; stage s's input gradient is sent back first and its weight-gradient
GEMMs run while it travels. The whole pipeline is one custom-backward function
(``compat.autograd.Function``), so the backward order is ours, not autograd's.

Dropless (no capacity); rows, counts and results are those of the plain all-to-all dispatcher,
only the order of independent work changes. With ``C = G = 1`` it is the plain schedule.

On Ascend the asynchronous all-to-alls are native hccl ones (untested here: no device). On CPU
they run on ``parallel.comm``'s communication thread; whether that hides time depends on free
cores (on this 2-core machine with two busy workers: 1.13x the ``alltoall`` dispatcher at G=2,
62% of the all-to-all time hidden; ``benchmarks/moe.py --mode ep``, ``docs/features/moe.md``).
A ``Timeline`` records every span (compute, comm, exposed wait) for the figure and the
hidden-fraction figure.
"""
from __future__ import annotations

import time
from typing import List, Optional

import numpy as np
from mindspore import Tensor, mint, ops

from ms_llm.compat.autograd import Function
from ms_llm.ops import moe as moe_ops
from . import comm
from .expert_parallel import MoEAlltoAllTokenDispatcher, gather_rows, regroup_indices


class Timeline:
    """Spans ``(rank, phase, kind, group, t0, t1)`` with ``perf_counter`` times; ``kind`` is
    ``compute``, ``comm`` (on the communication thread) or ``wait`` (main thread blocked)."""

    def __init__(self):
        self.events: List[dict] = []
        self.enabled = True

    def add(self, phase: str, kind: str, group, t0: float, t1: float, name: str = ""):
        if self.enabled:
            self.events.append({"rank": comm.get_rank(), "phase": phase, "kind": kind,
                                "group": group, "name": name, "t0": t0, "t1": t1})

    def clear(self) -> None:
        self.events = []

    def hidden_fraction(self) -> Optional[float]:
        """1 - exposed wait / total all-to-all time (None without timed comm spans)."""
        comm_t = sum(e["t1"] - e["t0"] for e in self.events if e["kind"] == "comm")
        wait_t = sum(e["t1"] - e["t0"] for e in self.events if e["kind"] == "wait")
        return None if comm_t <= 0 else max(0.0, 1.0 - wait_t / comm_t)


class _Plan:
    """Host-side layout of one forward. A *stage* is (token chunk c, expert group g): its split
    matrix, the local experts it feeds, their row counts and the regroup index."""

    def __init__(self, counts: np.ndarray, rank: int, groups: List[np.ndarray], chunks: int):
        w = counts.shape[0]
        n_exp = counts.shape[1] // chunks
        n_local = n_exp // w
        counts = counts.reshape(w, chunks, n_exp)
        self.stage_ids, self.labels = [], []
        self.matrices, self.sizes, self.index, self.inverse = [], [], [], []
        for c in range(chunks):
            for gi, g in enumerate(groups):
                cols = np.array([j * n_local + l for j in range(w) for l in g])
                m = counts[:, c, cols].reshape(w, w, len(g)).sum(-1)       # [src, dst]
                blocks = counts[:, c, rank * n_local + g]                  # [src, local e]
                idx, inv = regroup_indices(blocks)
                self.stage_ids.append(g)
                self.labels.append(f"c{c}g{gi}" if chunks > 1 else f"g{gi}")
                self.matrices.append(m)
                self.sizes.append([int(v) for v in blocks.sum(0)])
                self.index.append(idx)
                self.inverse.append(inv)

    def send_rows(self, rank: int) -> List[int]:
        return [int(m[rank].sum()) for m in self.matrices]

    def recv_rows(self, rank: int) -> List[int]:
        return [int(m[:, rank].sum()) for m in self.matrices]


def _pick(w, ids):
    return [w[int(i)] for i in ids]


class _Pipeline(Function):
    @staticmethod
    def forward(ctx, permuted, plan, group, experts, timeline, *params):
        r = group.rank
        # The weights as this forward sees them (under FSDP, gathered ones): backward must use
        # these, not whatever the module attributes hold by then.
        w1, w2, tb = experts.expert_weights()
        segments = _split(permuted, plan.send_rows(r))
        recv_rows = plan.recv_rows(r)
        n_groups = len(plan.stage_ids)
        pending = {}

        def start(g):
            buf = mint.zeros((recv_rows[g],) + tuple(permuted.shape[1:]), dtype=permuted.dtype)
            pending[g] = (buf, comm.all_to_all_v(buf, segments[g], plan.matrices[g], group,
                                                 async_op=True))

        start(0)
        saved, outs, combines = [], [], []
        for g, ids in enumerate(plan.stage_ids):
            if g + 1 < n_groups:
                start(g + 1)
            buf, work = pending.pop(g)
            _wait(work, timeline, "fwd", "dispatch", plan.labels[g])
            t0 = time.perf_counter()
            x = gather_rows(buf, plan.index[g])
            y, kept = moe_ops.expert_ffn_forward(x, _pick(w1, ids), _pick(w2, ids), plan.sizes[g],
                                              tb)
            y_src = gather_rows(y, plan.inverse[g])
            if timeline is not None:
                timeline.add("fwd", "compute", plan.labels[g], t0, time.perf_counter(),
                             "gemm1+swiglu+gemm2")
            saved.append((x, kept))
            out = mint.zeros((segments[g].shape[0],) + tuple(y.shape[1:]), dtype=y.dtype)
            combines.append((g, comm.all_to_all_v(out, y_src, plan.matrices[g].T, group,
                                                  async_op=True)))
            outs.append(out)
        for g, work in combines:
            _wait(work, timeline, "fwd", "combine", plan.labels[g])
        ctx.plan, ctx.group, ctx.timeline, ctx.saved = plan, group, timeline, saved
        ctx.weights, ctx.param_shapes = (w1, w2, tb), [tuple(p.shape) for p in params]
        return _cat(outs, permuted)

    @staticmethod
    def backward(ctx, dout):
        plan, group, timeline = ctx.plan, ctx.group, ctx.timeline
        r = group.rank
        w1, w2, tb = ctx.weights
        n_local = len(moe_ops.per_expert(w1))
        d_segments = _split(dout.contiguous(), plan.send_rows(r))
        recv_rows = plan.recv_rows(r)
        pending = {}

        def start(g):   # the combine's backward: gradients travel to the experts
            buf = mint.zeros((recv_rows[g],) + tuple(dout.shape[1:]), dtype=dout.dtype)
            pending[g] = (buf, comm.all_to_all_v(buf, d_segments[g], plan.matrices[g], group,
                                                 async_op=True))

        dw1, dw2 = [None] * n_local, [None] * n_local
        d_outs, sends = [], []
        start(0)
        for g, ids in enumerate(plan.stage_ids):
            if g + 1 < len(plan.stage_ids):
                start(g + 1)
            buf, work = pending.pop(g)
            _wait(work, timeline, "bwd", "grad dispatch", plan.labels[g])
            x, kept = ctx.saved[g]
            t0 = time.perf_counter()
            dy = gather_rows(buf, plan.index[g])
            g_w1, g_w2 = _pick(w1, ids), _pick(w2, ids)
            dx, dh = moe_ops.expert_ffn_backward_data(dy, kept, g_w1, g_w2, plan.sizes[g], tb)
            dx_src = gather_rows(dx, plan.inverse[g])
            t1 = time.perf_counter()
            d_in = mint.zeros((d_segments[g].shape[0],) + tuple(dx.shape[1:]), dtype=dx.dtype)
            sends.append((g, comm.all_to_all_v(d_in, dx_src, plan.matrices[g].T, group,
                                               async_op=True)))
            d_outs.append(d_in)
            # Weight gradients while the input gradient travels back.
            gw1, gw2 = moe_ops.expert_ffn_backward_weight(dy, x, kept, dh, g_w1, g_w2,
                                                          plan.sizes[g], tb)
            for k, e in enumerate(ids):     # an expert recurs once per token chunk
                e = int(e)
                dw1[e] = gw1[k] if dw1[e] is None else dw1[e] + gw1[k]
                dw2[e] = gw2[k] if dw2[e] is None else dw2[e] + gw2[k]
            if timeline is not None:
                timeline.add("bwd", "compute", plan.labels[g], t0, t1, "dgrad")
                timeline.add("bwd", "compute", plan.labels[g], t1, time.perf_counter(), "wgrad")
        for g, work in sends:
            _wait(work, timeline, "bwd", "grad combine", plan.labels[g])
        ctx.saved = ctx.weights = None
        dx_all = _cat(d_outs, dout)
        return (dx_all, None, None, None, None) + tuple(_param_grads(dw1, dw2, ctx.param_shapes))


def _param_grads(dw1: list, dw2: list, shapes: list) -> list:
    """Per-expert weight gradients in the order of ``experts.weight_params()``: one tensor per
    expert weight (SequentialMLP), or the two flat GroupedMLP weights (``[E, ...]`` blocks)."""
    if len(shapes) == 2 * len(dw1):
        return list(dw1) + list(dw2)
    stack = [mint.cat([g.reshape(1, *g.shape) for g in d], 0) for d in (dw1, dw2)]
    return [stack[0].reshape(shapes[0]), stack[1].reshape(shapes[1])]


def _wait(work, timeline: Optional[Timeline], phase: str, name: str, g: str) -> None:
    t0 = time.perf_counter()
    work.wait()
    if timeline is not None:
        timeline.add(phase, "wait", g, t0, time.perf_counter(), name)
        if work.timing is not None:
            timeline.add(phase, "comm", g, work.timing[0], work.timing[1], name)


def _split(x: Tensor, rows: List[int]) -> List[Tensor]:
    if len(rows) == 1:
        return [x]
    offsets = np.concatenate([[0], np.cumsum(rows)])
    return [mint.narrow(x, 0, int(offsets[i]), n).contiguous() for i, n in enumerate(rows)]


def _cat(parts: List[Tensor], like: Tensor) -> Tensor:
    parts = [p for p in parts if p.shape[0]]
    if not parts:
        return mint.zeros((0,) + tuple(like.shape[1:]), dtype=like.dtype)
    return parts[0] if len(parts) == 1 else mint.cat(parts, 0)


class MegaMoEDispatcher(MoEAlltoAllTokenDispatcher):
    """``moe.dispatcher: megamoe``: the all-to-all dispatcher's routing, with the experts run
    in pipelined stages (``run`` replaces permute -> experts -> unpermute)."""

    def __init__(self, num_experts: int, topk: int, group: comm.ProcessGroup,
                 expert_groups: int = 2, token_chunks: int = 1,
                 timeline: Optional[Timeline] = None):
        super().__init__(num_experts, topk, group)
        if expert_groups < 1:
            raise ValueError(f"moe.expert_groups must be >= 1, got {expert_groups}")
        if token_chunks < 1:
            raise ValueError(f"moe.token_chunks must be >= 1, got {token_chunks}")
        self.token_chunks = token_chunks
        n_groups = min(expert_groups, self.num_local_experts)
        self.groups = [g for g in np.array_split(np.arange(self.num_local_experts), n_groups)]
        self.timeline = timeline
        # Sort position of every global expert: group-major, then destination rank, then the
        # expert inside the group, so each (group, destination) block is contiguous.
        w, n_local = group.size, self.num_local_experts
        order = [j * n_local + int(l) for g in self.groups for j in range(w) for l in g]
        self._position = np.empty(num_experts, np.int32)
        self._position[order] = np.arange(num_experts, dtype=np.int32)
        self._order = np.asarray(order)

    def run(self, hidden_states: Tensor, probs: Tensor, top_indices: Tensor, experts) -> Tensor:
        n_tok, n_exp = top_indices.shape[0], self.num_experts
        chunks = max(1, min(self.token_chunks, n_tok))
        # Sort key: token chunk, then the expert's position (group, destination, expert).
        key = ops.gather(Tensor(self._position), top_indices.reshape(-1), 0).reshape(
            top_indices.shape)
        if chunks > 1:
            chunk_of = (np.arange(n_tok) * chunks // n_tok).astype(np.int32) * n_exp
            key = key + Tensor(chunk_of.reshape(-1, 1))
        sorted_slots, restore, per_key = moe_ops.sort_by_expert(key, chunks * n_exp)
        counts = np.zeros((chunks, n_exp), np.int64)
        counts[:, self._order] = np.asarray(per_key).reshape(chunks, n_exp)  # global expert order
        all_counts = self.exchange_counts(counts.reshape(-1))
        plan = _Plan(all_counts, self.group.rank, self.groups, chunks)
        permuted = moe_ops.permute(hidden_states, sorted_slots, self.topk)
        out = _Pipeline.apply(permuted, plan, self.group, experts, self.timeline,
                              *experts.weight_params())
        return moe_ops.unpermute(out, restore, probs)


def make_dispatcher(layer, group: comm.ProcessGroup, *, expert_groups: int = 2,
                    token_chunks: int = 1, timeline: Optional[Timeline] = None
                    ) -> MegaMoEDispatcher:
    """The ``megamoe`` entry of ``expert_parallel``'s dispatcher registry."""
    if not getattr(layer.experts, "plain_linears", lambda: True)():
        raise ValueError("moe.dispatcher megamoe runs the expert GEMMs itself and does not "
                         "support quantized (MXFP8) experts; use moe.dispatcher alltoall or add "
                         "'*.experts.*' to quant.ignored_modules")
    c = layer.config
    return MegaMoEDispatcher(c.num_moe_experts, c.moe_router_topk, group, expert_groups,
                             token_chunks, timeline=timeline)
