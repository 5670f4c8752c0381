"""Muon (``training.optimizer: muon``): momentum orthogonalised by Newton-Schulz on the hidden
matrices, AdamW on everything else, as Megatron-Core's ``TensorParallelMuon`` (NVIDIA
``emerging_optimizers``' ``OrthogonalizedOptimizer``) does it.

Per Muon parameter and step (``lr`` times the group's ``lr_mult``):

    p   <- p - lr * wd * p                               (decoupled weight decay)
    buf <- momentum * buf + (1 - momentum) * g           (EMA, ``lerp``)
    u   <- (1 - momentum) * g + momentum * buf  if muon_nesterov else buf
    p   <- p - lr * scale(out, in) * extra_scale_factor * NS(u)

``NS`` is ``newton_schulz`` in fp32 per matrix: the fused QKV weight split into its Q, K and V
matrices across the query groups (``muon_split_qkv``, Megatron's per-group view), ``linear_fc1``
as one ``[gate; up]`` matrix, grouped expert weights (``experts.weight1/2``) one matrix per
expert. ``scale`` is ``muon_scale_mode``'s (``spectral`` sqrt(max(out, in)) by default).

Data parallel (with ``pstate``): every replica holds the same reduced gradient and momentum, so
each matrix is orthogonalised once, on the rank of its replica group (``dp``/``edp``, times
``cp``) that owns it (matrices dealt out by size), and the group all-gathers the updates, as
Megatron's layer-wise optimizer does; every rank then applies identical updates. FSDP: the
momentum is kept on the shard; the owner gathers the whole matrix, and each rank keeps its rows
of the update (``OwnerPlan``). Tensor parallel ``blockwise``: each rank orthogonalises its own
shard; ``duplicated`` and ``distributed`` (``muon_tp``) orthogonalise the whole matrix.
Non-matrix parameters (embeddings, output layer, norms, biases, router) take ``AdamW`` with the
``adam_*`` options. Momentum buffers are checkpointed as ``optimizer.momentum_buffer.<name>``.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
from mindspore import Parameter, Tensor, mint

from ms_llm.compat import F, float32, zeros
from ms_llm.parallel import comm
from ms_llm.parallel.placement import RowShard, grad_replica_dim, placement_of
from .adamw import AdamW
from .muon_tp import TensorParallelNS, partition_dim
from .base import Optimizer, StateTensor
from .newton_schulz import batch_chunks, coefficient_schedule, newton_schulz, scale_factor
from .param_groups import ParamGroup, assignment, build_groups, is_muon_matrix

FP32 = 4
BATCH_MAX = 1 << 17   # matrices up to this many elements (e.g. 128 x 1024) are batched by shape


def matrix_view(name: str, shape: Tuple[int, ...], model_config, split_qkv: bool) -> tuple:
    """How parameter ``name`` (local ``shape``) is cut into the matrices Newton-Schulz sees:
    ``("qkv", groups, [q, k, v] rows per group)``, ``("experts", E, in, out)`` (grouped expert
    weights stored ``[E, in, out]``), or ``("plain",)`` (one ``[out, in]`` matrix)."""
    c = model_config
    if split_qkv and name.endswith("linear_qkv.weight") and c is not None:
        r, d = c.num_attention_heads // c.num_query_groups, c.kv_channels
        per = (r + 2) * d
        if shape[0] % per:
            raise ValueError(f"muon_split_qkv: {name} has {shape[0]} rows, not a multiple of "
                             f"one query group's {per}")
        return ("qkv", shape[0] // per, [r * d, d, d])
    if c is not None and name.endswith(("experts.weight1", "experts.weight2")) \
            and c.moe_ffn_hidden_size:
        # Stored expert-major in memory, whatever the 2-D shape (``[H, E*2F]``, or the
        # ``[E*H, 2F]`` rows a distributed-optimizer shard is cut from): E from the count.
        f, h, n = c.moe_ffn_hidden_size, c.hidden_size, int(np.prod(shape))
        if name.endswith("weight1"):              # [H, E*2F] viewed [E, H, 2F]
            return ("experts", n // (2 * f * h), h, 2 * f)
        return ("experts", n // (f * h), f, h)    # [E*F, H] viewed [E, F, H]
    return ("plain",)


class Muon:
    """Muon over the ``muon`` group's parameters, ``adam(named, groups)`` over the rest."""
    grad_sync = None

    def __init__(self, named_params: Sequence[tuple], lr: float = 1e-3, momentum: float = 0.95,
                 nesterov: bool = False, weight_decay: float = 0.01,
                 coefficient_type: str = "quintic", num_ns_steps: int = 5,
                 scale_mode: str = "spectral", extra_scale_factor: float = 1.0,
                 split_qkv: bool = True, model_config=None, tp_mode: str = "duplicated",
                 groups: Optional[Mapping[str, ParamGroup]] = None,
                 adam: Optional[Callable[..., Optimizer]] = None, pstate=None):
        if groups is None:
            groups = assignment(build_groups(named_params, muon=True))
        self.names = [n for n, _ in named_params]
        self.params: List[Parameter] = [p for _, p in named_params]
        for n, p in named_params:
            if p.dtype != float32:
                raise TypeError(f"Muon: parameter {n} is {p.dtype}; fp32 master weights required")
        self.groups = list({id(g): g for g in (groups[n] for n in self.names)}.values())
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.weight_decay, self.extra_scale_factor = weight_decay, extra_scale_factor
        self.schedule = coefficient_schedule(coefficient_type, num_ns_steps)
        self.scale_mode = scale_mode
        scale_factor(1, 1, scale_mode)            # a bad mode fails here, not at step 1
        self.is_muon = [groups[n].optimizer == "muon" for n in self.names]
        self.muon_idx = [i for i, m in enumerate(self.is_muon) if m]
        self.adam_idx = [i for i, m in enumerate(self.is_muon) if not m]
        adam_named = [named_params[i] for i in self.adam_idx]
        adam = adam or functools.partial(AdamW, lr=lr, weight_decay=weight_decay)
        self.adam = adam(adam_named, groups=groups)
        self.lr_mult = {i: groups[self.names[i]].lr_mult for i in self.muon_idx}
        self.wd_mult = {i: groups[self.names[i]].wd_mult for i in self.muon_idx}
        self.momentum_buffer = {i: Parameter(zeros(self.params[i].shape), requires_grad=False,
                                             name=f"momentum_buffer.{self.names[i]}")
                                for i in self.muon_idx}
        self._slot = {id(p): i for i, p in enumerate(self.params)}
        self.owners = OwnerPlan(self.params, self.muon_idx, self.names, pstate)
        self.views = {i: matrix_view(self.names[i], self.owners.full[i], model_config, split_qkv)
                      for i in self.muon_idx}
        self.tp_ns = TensorParallelNS(tp_mode, pstate.group("tp") if pstate else None)
        self.tp_dim = {i: partition_dim(self.params[i]) for i in self.muon_idx}

    @property
    def step_count(self) -> int:
        return self.adam.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.adam.step_count = value

    # ------------------------------------------------------------------ the update
    def matrices(self, i: int, u: Tensor) -> List[Tensor]:
        """The matrices Newton-Schulz sees in parameter ``i``'s momentum ``u`` (``matrix_view``):
        Q, K and V across the query groups, one ``[E, in, out]`` batch of experts, or ``u``."""
        view = self.views[i]
        if view[0] == "qkv":
            ng, rows, h = view[1], view[2], u.shape[-1]
            return [part.reshape(-1, h) for part in
                    mint.split(u.reshape(ng, sum(rows), h), rows, dim=1)]
        if view[0] == "experts":
            return [u.reshape(view[1:])]
        return [u]

    def assemble(self, i: int, u: Tensor, parts: List[Tensor]) -> Tensor:
        """``matrices``' inverse: the orthogonalised parts back in ``u``'s layout."""
        if self.views[i][0] == "qkv":
            ng = self.views[i][1]
            return mint.cat([o.reshape(ng, -1, u.shape[-1]) for o in parts], dim=1
                            ).reshape(u.shape)
        return parts[0].reshape(u.shape)

    def orthogonalize(self, us: Dict[int, Tensor]) -> Dict[int, Tensor]:
        """The scaled Newton-Schulz updates of the parameters ``us`` maps to their momenta.

        Small matrices of one shape (K and V of every layer, ...) go through one batched
        Newton-Schulz: one dispatch per op for the batch instead of one per matrix, which is
        most of their cost on CPU. Larger ones (above ``BATCH_MAX`` elements) run alone: there
        the GEMMs dominate and MindSpore's CPU batched matmul measured slower than a loop of 2-D
        ones (``benchmarks/muon.py``). Grouped experts are one batch of their own. A
        tensor-parallel shard in ``duplicated``/``distributed`` mode takes its own collective
        path."""
        s, items, batches, out = self.extra_scale_factor, [], {}, {}
        for i, u in us.items():
            dim = self.tp_dim[i]
            for k, m in enumerate(self.matrices(i, u)):
                size = self.tp_ns.global_shape(m.shape, dim)
                scale = scale_factor(size[0], size[1], self.scale_mode) * s
                items.append((i, k, m, scale, dim))
                if self.tp_ns.split_dim(dim) is None and m.shape[-1] * m.shape[-2] <= BATCH_MAX:
                    batches.setdefault(tuple(m.shape[-2:]), []).append(len(items) - 1)
        done: Dict[int, Tensor] = {}
        for shape, members in batches.items():
            for chunk in batch_chunks(members, [items[j][2] for j in members]):
                mats = [items[j][2] for j in chunk]
                if len(mats) == 1:
                    done[chunk[0]] = newton_schulz(mats[0], self.schedule)
                    continue
                counts = [int(np.prod(m.shape[:-2])) for m in mats]
                batch = mint.cat([m.reshape((-1,) + shape) for m in mats])
                for j, o, m in zip(chunk, mint.split(newton_schulz(batch, self.schedule),
                                                     counts), mats):
                    done[j] = o.reshape(m.shape)
        parts: Dict[int, List[Tensor]] = {}
        for j, (i, k, m, scale, dim) in enumerate(items):
            o = done[j] if j in done else self.tp_ns(m, dim, self.schedule)
            parts.setdefault(i, []).append(o * scale)
        for i, u in us.items():
            out[i] = self.assemble(i, u, parts[i])
        return out

    def step(self, grads: Sequence[Tensor], lr: Optional[float] = None) -> None:
        lr = self.lr if lr is None else lr
        self.adam.step([grads[i] for i in self.adam_idx], lr)
        m, us = self.momentum, {}
        for i in self.muon_idx:     # one fused op per term (lerp), not three
            g, buf = grads[i], self.momentum_buffer[i]
            F.copy_(buf, mint.lerp(buf, g, 1.0 - m))
            us[i] = mint.lerp(g, buf, m) if self.nesterov else buf
        full = self.owners.gather(us)
        updates = self.orthogonalize({i: full[i] for i in self.muon_idx
                                      if self.owners.mine(i)})
        self.owners.exchange(updates)
        for i in self.muon_idx:
            p, lr_p = self.params[i], lr * self.lr_mult[i]
            decay = lr_p * self.weight_decay * self.wd_mult[i]
            F.copy_(p, (p * (1.0 - decay) if decay else p) - updates[i] * lr_p)

    # ------------------------------------------------------------------ the protocol
    def state_tensors(self, param: Parameter) -> List[StateTensor]:
        """A Muon matrix's momentum buffer (its placement), or AdamW's moments."""
        i = self._slot.get(id(param))
        if i is None:
            return []
        if not self.is_muon[i]:
            return self.adam.state_tensors(param)
        return [StateTensor("optimizer.momentum_buffer.", self.momentum_buffer[i],
                            placement_of(param))]

    def checkpoint_tensor(self, param: Parameter) -> Optional[Parameter]:
        """The parameters are the master weights."""
        return param

    def load_finished(self) -> None:
        self.adam.load_finished()

    def state_bytes(self) -> Dict[str, int]:
        out = dict(self.adam.state_bytes())
        out["momentum_buffer"] = sum(int(b.size) * FP32 for b in self.momentum_buffer.values())
        return out

    @staticmethod
    def state_elements(name: str, shape: Sequence[int]) -> int:
        """One momentum buffer per Muon matrix element, AdamW's two moments elsewhere."""
        return 1 if is_muon_matrix(name, len(shape)) else 2

    def state_dict(self) -> Dict[str, np.ndarray]:
        out = self.adam.state_dict()
        for i, buf in self.momentum_buffer.items():
            out[f"momentum_buffer.{self.names[i]}"] = buf.asnumpy()
        return out

    def load_state_dict(self, state: Dict[str, np.ndarray], source: str = "optimizer state"
                        ) -> None:
        self.adam.load_state_dict(state, source)
        for i, buf in self.momentum_buffer.items():
            key = f"momentum_buffer.{self.names[i]}"
            if key not in state:
                raise KeyError(f"{source}: missing {key!r}")
            buf.set_data(Tensor(np.asarray(state[key], np.float32)))


class OwnerPlan:
    """Which rank of each group orthogonalises which Muon matrix (dealt out greedily by size,
    the same deal on every rank), and the collectives around it.

    A replicated matrix (data parallel: ``dp``/``edp``, times ``cp``) is whole on every rank:
    the owner orthogonalises it and one all-gather per group hands every rank all the updates.
    An FSDP shard (dim 0 cut over its ``dp_cut`` group, uneven included) is first all-gathered
    (one flat all-gather per group, each shard padded to the chunk), the owner orthogonalises
    the whole matrix, the updates are all-gathered the same way and each rank keeps its rows."""

    def __init__(self, params: Sequence[Parameter], idx: Sequence[int], names: Sequence[str],
                 pstate=None):
        self.owner: Dict[int, int] = {}
        self.groups: Dict[str, tuple] = {}       # key -> (group, [param indices], fsdp)
        self.full: Dict[int, tuple] = {i: tuple(params[i].shape) for i in idx}
        self.shard: Dict[int, RowShard] = {}
        if pstate is None:
            return
        by_key: Dict[str, List[int]] = {}
        for i in idx:
            pl = placement_of(params[i])
            key = "fsdp:" + pl.dp_cut if pl.dp_cut is not None else \
                grad_replica_dim(pl) + ("_cp" if pstate.sizes.cp > 1 else "")
            by_key.setdefault(key, []).append(i)
        for key, members in by_key.items():
            fsdp = key.startswith("fsdp:")
            group = pstate.group(key[5:] if fsdp else key)
            if group.size == 1:
                continue
            if fsdp:      # every rank's row count: the full rows and this rank's chunk
                lengths = comm.exchange_split_sizes([params[i].shape[0] for i in members], group)
                for k, i in enumerate(members):
                    rows = int(lengths[:, k].sum())
                    self.shard[i] = RowShard(rows, group.size, group.rank)
                    self.full[i] = (rows,) + tuple(params[i].shape[1:])
            load = [0] * group.size
            for i in sorted(members, key=lambda j: (-int(np.prod(self.full[j])), j)):
                r = load.index(min(load))
                self.owner[i] = r
                load[r] += int(np.prod(self.full[i]))
            self.groups[key] = (group, members, fsdp)
        self._group_of = {i: g for g, m, _ in self.groups.values() for i in m}

    def mine(self, i: int) -> bool:
        """Whether this rank orthogonalises parameter ``i``."""
        return i not in self.owner or self.owner[i] == self._group_of[i].rank

    def gather(self, us: Dict[int, Tensor]) -> Dict[int, Tensor]:
        """``us`` with each FSDP shard this rank owns replaced by the whole matrix."""
        out = dict(us)
        for group, members, fsdp in self.groups.values():
            if not fsdp:
                continue
            flat = mint.cat([self._padded(us[i], i).reshape(-1) for i in members])
            parts = [mint.zeros(flat.shape, dtype=float32) for _ in range(group.size)]
            comm.all_gather(parts, flat, group=group)
            offset = 0
            for i in members:
                n = self.shard[i].chunk * int(np.prod(self.full[i][1:]))
                if self.mine(i):
                    rows = [mint.narrow(p, 0, offset, n).reshape((-1,) + self.full[i][1:])
                            for p in parts]
                    out[i] = mint.narrow(mint.cat(rows), 0, 0, self.full[i][0])
                offset += n
        return out

    def _padded(self, t: Tensor, i: int) -> Tensor:
        """Shard ``t`` with zero rows up to the chunk (uneven shards)."""
        pad = self.shard[i].chunk - t.shape[0]
        if not pad:
            return t
        return mint.cat([t, mint.zeros((pad,) + tuple(t.shape[1:]), dtype=t.dtype)])

    def exchange(self, updates: Dict[int, Tensor]) -> None:
        """Fill ``updates`` with every other rank's (one all-gather per group), then cut this
        rank's rows of each FSDP matrix."""
        for group, members, fsdp in self.groups.values():
            per_rank = [[i for i in members if self.owner[i] == r] for r in range(group.size)]
            sizes = [sum(int(np.prod(self.full[i])) for i in ids) for ids in per_rank]
            width, mine = max(sizes), per_rank[group.rank]
            pieces = [updates[i].reshape(-1) for i in mine]
            if sizes[group.rank] < width:
                pieces.append(mint.zeros((width - sizes[group.rank],), dtype=float32))
            parts = [mint.zeros((width,), dtype=float32) for _ in range(group.size)]
            comm.all_gather(parts, mint.cat(pieces), group=group)
            for r, ids in enumerate(per_rank):
                offset = 0
                for i in ids:
                    n = int(np.prod(self.full[i]))
                    if r != group.rank:
                        updates[i] = mint.narrow(parts[r], 0, offset, n).reshape(self.full[i])
                    offset += n
            if fsdp:
                for i in members:
                    sh = self.shard[i]
                    updates[i] = mint.narrow(updates[i], 0, sh.start, sh.length)
