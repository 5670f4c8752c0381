"""The communication half of Megatron's distributed optimizer
(``parallel.use_distributed_optimizer``: ZeRO-1 on the data-parallel group); the optimizer half,
which wraps any optimizer around the shards, is ``ms_llm.optim.distributed``.

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
3. the wrapped optimizer (AdamW, Muon...) on the shard (``ms_llm.optim``);
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
from . import comm
from .data_parallel import GradBuckets, PartitionedGradSync
from .fsdp.flat import FlatLayout
from .placement import Placement, RowShard, grad_replica_dim, placement_of


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


class ShardedGradBuckets(GradBuckets):
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


class ShardGradSync:
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


class ShardComm:
    """The distributed optimizer's collectives for ``model_params``, each cut along dim 0 over
    the group of its ``dims`` entry (``dp``, ``edp``, ``dp_cp``, ``edp_cp``): ``grad_sync``
    reduce-scatters gradients into the non-empty shards (``keep``), ``gather`` all-gathers
    updated main shards into the model parameters, on the reduce-scatter's buckets."""

    def __init__(self, model_params: Sequence[Parameter], dims: Sequence[str], groups: dict,
                 keep: Sequence[bool], overlap: bool, bucket_mb: float, grad_dtype=float32):
        self.model_params = list(model_params)
        parts = []
        for d in ("dp", "edp", "dp_cp", "edp_cp"):
            idx = [i for i, x in enumerate(dims) if x == d]
            if idx:
                parts.append((idx, [self.model_params[i] for i in idx], groups[d], True))
        self.grad_sync = ShardGradSync(
            PartitionedGradSync(parts, overlap=overlap, buckets=ShardedGradBuckets,
                                bucket_mb=bucket_mb, grad_dtype=grad_dtype), keep)
        self._gathers = []
        for idx, buckets in self.grad_sync.inner.parts:
            for b, bidx in enumerate(buckets.buckets):
                glob = [idx[i] for i in bidx]
                self._gathers.append((buckets.group, buckets.layouts[b], glob))

    def gather(self, mains: Sequence[Optional[Parameter]]) -> None:
        """Every model parameter of a group of more than one rank from the main shards
        (``mains``, aligned with ``model_params``): one all-gather per bucket, the next started
        before the previous is unpacked (two buckets' buffers at most)."""
        inflight = None
        for entry in self._gathers + [None]:
            started = None
            group, layout, idx = entry or (None, None, None)
            if group is not None and group.size > 1:
                flat = layout.pack_shards([mains[i] for i in idx], float32)
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


def bytes_per_rank(nbytes: int) -> List[int]:
    """Every world rank's ``nbytes`` (one all-gather; int32 halves keep it exact)."""
    rows = comm.exchange_split_sizes([nbytes >> 24, nbytes & (2 ** 24 - 1)])
    return [int(hi) * 2 ** 24 + int(lo) for hi, lo in rows]
