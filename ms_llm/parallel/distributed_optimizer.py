"""Megatron's distributed optimizer (``parallel.use_distributed_optimizer``): ZeRO-1 on the
data-parallel group.

The model keeps its full parameters (forward and backward are those of plain data parallel), but
the AdamW moments and the fp32 main parameters exist only as this rank's shard: each parameter's
dim 0 is cut with the chunk rule (``placement.RowShard``, the rule FSDP uses, uneven sizes
included: 5 rows on 4 ranks hold 2, 2, 1, 0) over the group its gradient is summed over -- the
data-parallel group, or the expert-data-parallel group for expert parameters (with context
parallel: those groups x cp, Megatron's dp-cp groups, whose cp ranks are replicas too). A step is

1. gradients reduce-scattered into the shard (``fsdp.flat.FlatLayout``: one flat buffer per
   bucket of parameters, one ``reduce_scatter_tensor`` per bucket -- on CPU the comm package's
   scatter-per-root composition -- started from backward hooks as each bucket completes, as
   plain data parallel starts its all-reduces);
2. the global norm and clipping on the shards (each shard's ``Placement`` adds the ``dp``/``edp``
   cut, so ``training.grad.global_norm`` sums its squares over that group too);
3. AdamW on the shard (the same fused kernel as ``training.optimizer.AdamW``);
4. the updated shards all-gathered (one flat ``all_gather`` per bucket) into the model's
   parameters.

Grouped expert weights (``row_blocks``) are cut along rows of their stored view over ``edp``, the
same rows ``placement.checkpoint_regions`` derives for that cut, so checkpoints of the moments are
regions of the global tensors, the format plain AdamW writes: saved under one data-parallel size
or optimizer, they load under another.

Overlap: each bucket's reduce-scatter starts from the backward hooks as soon as its last
gradient arrives (``async_op``; one bucket in flight, completed when the next starts), so on
Ascend it runs under the rest of backward. The all-gathers run after the update, the next
bucket's started before the previous one is unpacked; they are *not* overlapped with the next
forward (that needs forward pre-hooks per bucket, not built). On MindSpore's CPU backend (mccl)
collectives block the calling thread even when asynchronous, so nothing overlaps on CPU:
``benchmarks/distributed_optimizer.py`` measures the cost.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np
from mindspore import Parameter, Tensor, mint

from ms_llm.compat import F, float32
from ms_llm.training.mixed_precision import (MainParamsAdamW, fp32_main_copy, grad_dtype,
                                             grads_to_fp32)
from ms_llm.training.optimizer import AdamW, WrapsAdamW
from . import comm
from .data_parallel import GradBuckets, PartitionedGradSync
from .fsdp.flat import FlatLayout
from .placement import (Placement, RowShard, add_shard, grad_replica_dim, placement_of,
                        set_placement)


def row_shape(shape: Sequence[int], pl: Placement, dim: str) -> tuple:
    """The shape whose dim 0 the optimizer cuts: the tensor's own, or for grouped expert
    weights cut over ``edp`` the rows of their stored view (what ``checkpoint_regions`` cuts for
    a non-``dp`` mesh dim)."""
    if pl.layout == "row_blocks" and dim not in ("dp", "dp_cp"):
        return (int(np.prod(shape)) // pl.row_width, pl.row_width)
    if not shape:
        raise ValueError("distributed optimizer: a 0-dim parameter cannot be cut along dim 0")
    return tuple(shape)


def shard_rows(shape: Sequence[int], pl: Placement, dim: str, world: int, rank: int):
    """(row shape, this rank's ``RowShard``) of a parameter cut over a group of ``world``."""
    rows = row_shape(shape, pl, dim)
    return rows, RowShard(rows[0], world, rank)


class _ShardedGradBuckets(GradBuckets):
    """``GradBuckets`` whose collective is a reduce-scatter: each bucket's gradients are packed
    by a ``FlatLayout`` (parameters in their row shapes) and this rank receives its flat shard;
    each parameter's gradient is then its real rows, a view of that shard. At most one bucket
    is in flight (launching the next completes the previous, as FSDP does), so the transient
    buffers (packed input, per-root receive buffers) stay one bucket's size."""

    def __init__(self, params, group, **kwargs):
        super().__init__(params, group, **kwargs)
        w, r = group.size, max(group.rank, 0)
        self.rows = [row_shape(tuple(p.shape), placement_of(p),
                               grad_replica_dim(placement_of(p))) for p in self.params]
        self.layouts = [FlatLayout([self.rows[i] for i in idx], w, r) for idx in self.buckets]
        self._inflight: Optional[tuple] = None
        self._ready: Dict[int, Tensor] = {}

    def _launch(self, b: int) -> None:
        grads = [self._acc[i] for i in self.buckets[b]]
        for i in self.buckets[b]:
            self._acc[i] = None          # the packed input holds them now
        self._start(b, grads)

    def _start(self, b: int, grads) -> None:
        self._complete()
        layout, idx = self.layouts[b], self.buckets[b]
        flat_in = layout.pack_grads([g.reshape(self.rows[i]) for i, g in zip(idx, grads)],
                                    self.grad_dtype)
        out = mint.zeros((layout.numel,), dtype=self.grad_dtype)
        work = comm.reduce_scatter_tensor(out, flat_in, group=self.group, async_op=True)
        self._inflight = (b, out, work)

    def _complete(self) -> None:
        if self._inflight is not None:
            b, out, work = self._inflight
            self._inflight = None
            work.wait()
            self._ready[b] = out

    def _collect(self) -> List[Tensor]:
        self._complete()
        if len(self._ready) != len(self.buckets):
            raise RuntimeError("distributed optimizer: not every gradient bucket was "
                               "reduce-scattered; was begin_micro_batch(is_last=True) called "
                               "before the last backward?")
        out: List[Optional[Tensor]] = [None] * len(self.params)
        for b, flat in self._ready.items():
            for i, view in zip(self.buckets[b], self.layouts[b].shard_views(flat)):
                out[i] = view
        self._ready = {}
        return out

    def finish(self) -> List[Tensor]:
        out = self._collect()
        self._acc, self._active = [None] * len(self.params), False
        return out

    def reduce(self, grads: Sequence[Tensor]) -> List[Tensor]:
        if not self.enabled:
            return [g.reshape(rows) for g, rows in zip(grads, self.rows)]
        for b, idx in enumerate(self.buckets):
            self._start(b, [grads[i] for i in idx])
        return self._collect()


class _ShardGradSync:
    """The trainer's grad-sync interface over the reduce-scatter; hands back the gradients of
    the non-empty shards only (aligned with ``DistributedOptimizer.params``)."""

    def __init__(self, inner: PartitionedGradSync, keep: Sequence[bool]):
        self.inner, self.keep = inner, list(keep)
        self.overlap = inner.overlap

    def begin_micro_batch(self, is_last: bool) -> None:
        self.inner.begin_micro_batch(is_last)

    def _kept(self, grads) -> List[Tensor]:
        return [g for g, k in zip(grads, self.keep) if k]

    def finish(self) -> List[Tensor]:
        return self._kept(self.inner.finish())

    def reduce(self, grads: Sequence[Tensor]) -> List[Tensor]:
        return self._kept(self.inner.reduce(grads))


class DistributedOptimizer(WrapsAdamW):
    """AdamW whose state lives in dim-0 shards over each parameter's data-parallel group.

    ``params`` are the fp32 main-parameter shards (non-empty ones; their ``Placement`` is the
    model parameter's plus the ``dp``/``edp`` cut), aligned with the gradients ``grad_sync``
    returns and ``step`` takes. With a group of one rank the main parameter *is* the model
    parameter (no copy, no collective)."""

    def __init__(self, named_params: Sequence[tuple], pstate, lr: float = 1e-3,
                 betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 bucket_mb: float = 25.0, overlap: bool = True, grad_dtype=float32):
        self.model_names = [n for n, _ in named_params]
        self.model_params: List[Parameter] = [p for _, p in named_params]
        self.dims = [grad_replica_dim(placement_of(p)) for p in self.model_params]
        for n, d in zip(self.model_names, self.dims):
            if d is None:
                raise ValueError(f"parallel.use_distributed_optimizer: parameter {n} is already "
                                 f"sharded over data parallel (FSDP); use one of them")
        # Under context parallel the cp ranks are replicas too: cut over (e)dp x cp, Megatron's
        # data-parallel-with-context-parallel group (the gradient's whole replica group).
        if pstate.sizes.cp > 1:
            self.dims = [d + "_cp" for d in self.dims]
        self.groups = {d: pstate.group(d) for d in set(self.dims)}
        self.mains: List[Optional[Parameter]] = []
        self._rows: List[tuple] = []
        for n, p, d in zip(self.model_names, self.model_params, self.dims):
            self.mains.append(self._main_shard(n, p, d))
        named_main = [(n, m) for n, m in zip(self.model_names, self.mains) if m is not None]
        self.inner = AdamW(named_main, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.params = self.inner.params
        self.exp_avg, self.exp_avg_sq = self.inner.exp_avg, self.inner.exp_avg_sq
        self._slot = {id(p): i for i, p in enumerate(self.params)}
        self._model_slot = {id(p): i for i, p in enumerate(self.model_params)}
        parts = []
        for d in ("dp", "edp", "dp_cp", "edp_cp"):
            idx = [i for i, x in enumerate(self.dims) if x == d]
            if idx:
                parts.append((idx, [self.model_params[i] for i in idx], self.groups[d], True))
        self.grad_sync = _ShardGradSync(
            PartitionedGradSync(parts, overlap=overlap, buckets=_ShardedGradBuckets,
                                bucket_mb=bucket_mb, grad_dtype=grad_dtype),
            [m is not None for m in self.mains])
        # The all-gather uses the reduce-scatter's buckets and layouts.
        self._gathers = []
        for idx, buckets in self.grad_sync.inner.parts:
            for b, bidx in enumerate(buckets.buckets):
                glob = [idx[i] for i in bidx]
                self._gathers.append((buckets.group, buckets.layouts[b], glob))

    def _main_shard(self, name: str, p: Parameter, dim: str) -> Optional[Parameter]:
        g = self.groups[dim]
        pl = placement_of(p)
        rows, rs = shard_rows(tuple(p.shape), pl, dim, g.size, g.rank)
        self._rows.append(rows)
        if g.size == 1:   # the model parameter is its own main one, unless it is bf16
            return p if p.dtype == float32 else fp32_main_copy(name, p)
        if not rs.length:
            return None
        data = p.asnumpy().reshape(rows)[rs.start:rs.start + rs.length]
        main = Parameter(Tensor(np.ascontiguousarray(data, np.float32)), name=name,
                         requires_grad=False)
        set_placement(main, add_shard(p, tuple(p.shape), dim, 0))
        return main

    # ------------------------------------------------------------------ the step
    def step(self, grads: Sequence[Tensor], lr: Optional[float] = None) -> None:
        """AdamW on the shards, then the updated shards all-gathered into the model."""
        self.inner.step(grads_to_fp32(grads), lr)
        self.gather_params()

    def gather_params(self) -> None:
        """Every model parameter from the main shards of its group: one all-gather per bucket,
        the next one started before the previous is unpacked (two buckets' buffers at most)."""
        inflight = None
        for entry in self._gathers + [None]:
            started = None
            group, layout, idx = entry or (None, None, None)
            if group is not None and group.size > 1:
                flat = layout.pack_shards([self.mains[i] for i in idx], float32)
                parts = [mint.zeros((layout.numel,), dtype=float32) for _ in range(group.size)]
                started = (comm.all_gather(parts, flat, group=group, async_op=True), parts,
                           layout, idx)
            if inflight is not None:
                work, parts_, layout_, idx_ = inflight
                work.wait()
                for i, full in zip(idx_, layout_.unpack_full(parts_)):
                    p = self.model_params[i]
                    F.copy_(p, full.reshape(p.shape).astype(p.dtype))
            inflight = started
        for p, main, d in zip(self.model_params, self.mains, self.dims):
            if self.groups[d].size == 1 and main is not None and main is not p:   # bf16 model
                F.copy_(p, main.astype(p.dtype))

    # ------------------------------------------------------------------ state and checkpoints
    def state_tensors(self, param: Parameter) -> list:
        """``(checkpoint prefix, tensor, placement)`` of the moments of model parameter
        ``param`` held here (none when this rank's shard is empty)."""
        i = self._model_slot.get(id(param))
        main = self.mains[i] if i is not None else None
        if main is None:
            return []
        j = self._slot[id(main)]
        pl = placement_of(main)
        return [("optimizer.exp_avg.", self.exp_avg[j], pl),
                ("optimizer.exp_avg_sq.", self.exp_avg_sq[j], pl)]

    def checkpoint_tensor(self, param: Parameter) -> Optional[Parameter]:
        """What a checkpoint stores as model parameter ``param``: the parameter itself, or for a
        low-precision (bf16) model this rank's fp32 main shard (None: an empty shard here), so
        resuming a bf16 run is exact."""
        i = self._model_slot.get(id(param))
        if i is None or param.dtype == float32:
            return param
        return self.mains[i]

    def load_finished(self) -> None:
        """After the model parameters were loaded: take the main shards from them (a bf16
        model: the fp32 main shards were loaded, the model parameters are gathered from them)."""
        if any(p.dtype != float32 for p in self.model_params):
            self.gather_params()
            return
        for p, main, rows, d in zip(self.model_params, self.mains, self._rows, self.dims):
            if main is None or main is p:
                continue
            g = self.groups[d]
            rs = RowShard(rows[0], g.size, g.rank)
            data = p.asnumpy().reshape(rows)[rs.start:rs.start + rs.length]
            main.set_data(Tensor(np.ascontiguousarray(data, np.float32)))

    def state_bytes(self) -> Dict[str, int]:
        """This rank's bytes: AdamW moments, and fp32 main-parameter shards that are copies
        (a one-rank group updates the model parameter itself)."""
        moments = sum(int(m.size) * 4 * 2 for m in self.exp_avg)
        mains = sum(int(m.size) * 4 for m, p in zip(self.mains, self.model_params)
                    if m is not None and m is not p)
        return {"exp_avg+exp_avg_sq": moments, "main_params": mains}


def build_optimizer(named_params: Sequence[tuple], cfg, pstate, jit: bool = False):
    """The optimizer the config asks for: ``AdamW`` over the model's parameters, or with
    ``parallel.use_distributed_optimizer`` its dp-sharded form (whose ``grad_sync`` then replaces
    the plain data-parallel all-reduce). ``jit``: the step is compiled (no backward hooks)."""
    t, p = cfg.training, cfg.parallel
    kw = dict(lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
              weight_decay=t.weight_decay)
    if not p.use_distributed_optimizer:
        if any(q.dtype != float32 for _, q in named_params):   # training.bf16
            return MainParamsAdamW(named_params, **kw)
        return AdamW(named_params, **kw)
    overlap = p.ddp_overlap and not jit and pstate.sizes.pp == 1
    return DistributedOptimizer(named_params, pstate, bucket_mb=p.ddp_bucket_mb,
                                overlap=overlap, grad_dtype=grad_dtype(cfg), **kw)


def bytes_per_rank(nbytes: int) -> List[int]:
    """Every world rank's ``nbytes`` (one all-gather; int32 halves keep it exact)."""
    rows = comm.exchange_split_sizes([nbytes >> 24, nbytes & (2 ** 24 - 1)])
    return [int(hi) * 2 ** 24 + int(lo) for hi, lo in rows]
