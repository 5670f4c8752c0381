"""Megatron's distributed optimizer (``parallel.use_distributed_optimizer``, ZeRO-1) as a wrapper
of any optimizer.

The model keeps its full parameters; the optimizer's state and the fp32 main parameters exist
only as this rank's dim-0 shard of each parameter over the group its gradient is summed over
(``dp``/``edp``, times ``cp`` under context parallel), cut with the chunk rule (uneven sizes
included). Gradients are reduce-scattered into the shards, the wrapped optimizer (``make``:
AdamW, Muon...) updates the shards, and the shards are all-gathered into the model; the
collectives are ``ms_llm.parallel.distributed_optimizer.ShardComm``. Each shard carries the
parameter's ``Placement`` plus the ``dp`` cut, so checkpoints hold regions of the global
tensors (the format a plain optimizer writes: saved under one data-parallel size or optimizer,
they load under another), and the global norm sums over the group.
"""
from __future__ import annotations

import contextlib

from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
from mindspore import Parameter, Tensor

from ms_llm.compat import F, float32
from ms_llm.parallel.distributed_optimizer import ShardComm, shard_rows
from ms_llm.parallel.placement import RowShard, add_shard, grad_replica_dim, placement_of, \
    set_placement
from .base import Optimizer, StateTensor, Wrapper
from .main_params import FP32, fp32_main_copy, grads_to_fp32


class DistributedOptimizer(Wrapper):
    """``make(named main shards)`` run on this rank's dim-0 shards.

    ``params`` are the fp32 main-parameter shards (non-empty ones), aligned with the gradients
    ``grad_sync`` returns and ``step`` takes. With a group of one rank the main parameter *is*
    the model parameter (no copy, no collective), or its fp32 copy for a bf16 model."""

    def __init__(self, named_params: Sequence[tuple], pstate,
                 make: Callable[[Sequence[tuple]], Optimizer], bucket_mb: float = 25.0,
                 overlap: bool = True, grad_dtype=float32, gather_timer=None):
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
        self.groups_by_dim = {d: pstate.group(d) for d in set(self.dims)}
        self.mains: List[Optional[Parameter]] = []
        self._rows: List[tuple] = []
        for n, p, d in zip(self.model_names, self.model_params, self.dims):
            self.mains.append(self._main_shard(n, p, d))
        self.inner = make([(n, m) for n, m in zip(self.model_names, self.mains) if m is not None])
        self._model_slot = {id(p): i for i, p in enumerate(self.model_params)}
        self.comm = ShardComm(self.model_params, self.dims, self.groups_by_dim,
                              [m is not None for m in self.mains], overlap, bucket_mb, grad_dtype)
        self.grad_sync = self.comm.grad_sync
        # Megatron's ``params-all-gather`` timer (a context manager; none: not timed)
        self.gather_timer = gather_timer if gather_timer is not None else contextlib.nullcontext()

    def _main_shard(self, name: str, p: Parameter, dim: str) -> Optional[Parameter]:
        g = self.groups_by_dim[dim]
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
        """The wrapped optimizer on the shards, then the shards all-gathered into the model."""
        self.inner.step(grads_to_fp32(grads), lr)
        with self.gather_timer:
            self.gather_params()

    def gather_params(self) -> None:
        """Every model parameter from the main shards of its group."""
        self.comm.gather(self.mains)
        for p, main, d in zip(self.model_params, self.mains, self.dims):
            if self.groups_by_dim[d].size == 1 and main is not None and main is not p:
                F.copy_(p, main.astype(p.dtype))          # bf16 model, one-rank group

    # ------------------------------------------------------------------ state and checkpoints
    def state_tensors(self, param: Parameter) -> List[StateTensor]:
        """The wrapped optimizer's state of model parameter ``param`` held here (its main
        shard's placement; none when this rank's shard is empty)."""
        i = self._model_slot.get(id(param))
        main = self.mains[i] if i is not None else None
        return [] if main is None else self.inner.state_tensors(main)

    def checkpoint_tensor(self, param: Parameter) -> Optional[Parameter]:
        """What a checkpoint stores as model parameter ``param``: the parameter itself, or for a
        low-precision (bf16) model this rank's fp32 main shard (None: an empty shard here), so
        resuming a bf16 run is exact."""
        i = self._model_slot.get(id(param))
        if i is None or param.dtype == float32:
            return param
        return self.mains[i]

    def main_shard(self, param: Parameter) -> tuple:
        """(this rank's fp32 main shard of model parameter ``param`` or None when empty, the
        index of its first row in ``param``): what an in-place edit of the weights after the
        step (QK-clip) must change so that the next all-gather keeps it."""
        i = self._model_slot[id(param)]
        g = self.groups_by_dim[self.dims[i]]
        return self.mains[i], RowShard(self._rows[i][0], g.size, g.rank).start

    def load_finished(self) -> None:
        """After the model parameters were loaded: take the main shards from them (a bf16
        model: the fp32 main shards were loaded, the model parameters are gathered from them)."""
        self.inner.load_finished()
        if any(p.dtype != float32 for p in self.model_params):
            self.gather_params()
            return
        for p, main, rows, d in zip(self.model_params, self.mains, self._rows, self.dims):
            if main is None or main is p:
                continue
            g = self.groups_by_dim[d]
            rs = RowShard(rows[0], g.size, g.rank)
            data = p.asnumpy().reshape(rows)[rs.start:rs.start + rs.length]
            main.set_data(Tensor(np.ascontiguousarray(data, np.float32)))

    def state_bytes(self) -> Dict[str, int]:
        """This rank's bytes: the wrapped optimizer's state, and fp32 main-parameter shards
        that are copies (a one-rank group updates the model parameter itself)."""
        out = dict(self.inner.state_bytes())
        out["main_params"] = sum(int(m.size) * FP32 for m, p in zip(self.mains, self.model_params)
                                 if m is not None and m is not p)
        return out
