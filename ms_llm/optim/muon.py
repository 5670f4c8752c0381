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
each matrix is orthogonalised once, on the rank of its replica group (``dp``/``edp``, times ``cp``)
that owns it (matrices dealt out by size), and the group all-gathers the updates, as Megatron's
layer-wise optimizer does; every rank then applies identical updates. FSDP: the momentum is kept on
the shard; the owner receives the other ranks' rows of the matrix, and each rank receives its rows
of the update (all-to-alls, ``muon_owners.OwnerPlan``). Tensor parallel ``blockwise``: each rank
orthogonalises its own shard; ``duplicated`` and ``distributed`` (``muon_tp``) orthogonalise the
whole matrix.
Non-matrix parameters (embeddings, output layer, norms, biases, router) take ``AdamW`` with the
``adam_*`` options. Momentum buffers are checkpointed as ``optimizer.momentum_buffer.<name>``.
"""
from __future__ import annotations

import contextlib
import functools
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
from mindspore import Parameter, Tensor, mint

from ms_llm.compat import F, float32, zeros
from ms_llm.parallel import comm
from ms_llm.parallel.placement import RowShard, grad_replica_dim, placement_of
from .adamw import AdamW
from .muon_owners import OwnerPlan
from .muon_tp import TensorParallelNS, partition_dim
from .base import Optimizer, StateTensor
from .newton_schulz import batch_chunks, check_matmul_precision, coefficient_schedule, \
    newton_schulz, scale_factor, use_kernel
from .param_groups import ParamGroup, assignment, build_groups, matrices_rule

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
                 fp32_matmul_prec: str = "highest",
                 groups: Optional[Mapping[str, ParamGroup]] = None,
                 adam: Optional[Callable[..., Optimizer]] = None, pstate=None):
        if groups is None:
            groups = assignment(build_groups(named_params, matrices_rule("muon", "adamw")))
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
        check_matmul_precision(fp32_matmul_prec)
        self.precision = fp32_matmul_prec
        self.kernel = use_kernel()   # Newton-Schulz as the CPU op (False: composed, to compare)
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
        self.tp_ns = TensorParallelNS(tp_mode, pstate.group("tp") if pstate else None,
                                      fp32_matmul_prec)
        self.tp_dim = {i: partition_dim(self.params[i]) for i in self.muon_idx}
        # Seconds per step phase when a dict (``benchmarks/muon_fsdp.py``'s breakdown); None
        # (the default) times nothing.
        self.timings: Optional[Dict[str, float]] = None

    def phase(self, name: str):
        """A context that adds its wall time to ``timings[name]`` (PyNative on CPU runs
        synchronously, so the wall time is the phase's)."""
        if self.timings is None:
            return contextlib.nullcontext()
        return _Phase(self.timings, name)

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

        Matrices of one shape (K and V of every layer, ...) go through one batched
        Newton-Schulz: with the CPU kernel all of them (one op for the whole iteration of the
        batch); composed, only small ones, where one dispatch per op for the batch instead of
        one per matrix is most of their cost -- larger ones (above ``BATCH_MAX`` elements) run
        alone there: the GEMMs dominate and MindSpore's CPU batched matmul measured slower than
        a loop of 2-D ones (``benchmarks/muon.py``). Grouped experts are one batch. A
        tensor-parallel shard in ``duplicated``/``distributed`` mode takes its own collective
        path."""
        s, items, batches, out = self.extra_scale_factor, [], {}, {}
        limit = None if self.kernel else BATCH_MAX
        for i, u in us.items():
            dim = self.tp_dim[i]
            for k, m in enumerate(self.matrices(i, u)):
                size = self.tp_ns.global_shape(m.shape, dim)
                scale = scale_factor(size[0], size[1], self.scale_mode) * s
                items.append((i, k, m, scale, dim))
                if self.tp_ns.split_dim(dim) is None and \
                        (limit is None or m.shape[-1] * m.shape[-2] <= limit):
                    batches.setdefault(tuple(m.shape[-2:]), []).append(len(items) - 1)
        done: Dict[int, Tensor] = {}
        for shape, members in batches.items():
            for chunk in batch_chunks(members, [items[j][2] for j in members]):
                mats = [items[j][2] for j in chunk]
                if len(mats) == 1:
                    done[chunk[0]] = newton_schulz(mats[0], self.schedule,
                                                   precision=self.precision, kernel=self.kernel)
                    continue
                counts = [int(np.prod(m.shape[:-2])) for m in mats]
                batch = mint.cat([m.reshape((-1,) + shape) for m in mats])
                ns = newton_schulz(batch, self.schedule, precision=self.precision,
                                   kernel=self.kernel)
                for j, o, m in zip(chunk, mint.split(ns, counts), mats):
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
        with self.phase("adamw"):
            self.adam.step([grads[i] for i in self.adam_idx], lr)
        m, us = self.momentum, {}
        with self.phase("momentum"):
            for i in self.muon_idx:     # one fused op per term (lerp), not three
                g, buf = grads[i], self.momentum_buffer[i]
                F.copy_(buf, mint.lerp(buf, g, 1.0 - m))
                us[i] = mint.lerp(g, buf, m) if self.nesterov else buf
        with self.phase("gather"):
            full = self.owners.gather(us)
        with self.phase("newton_schulz"):
            updates = self.orthogonalize({i: full[i] for i in self.muon_idx
                                          if self.owners.mine(i)})
        with self.phase("exchange"):
            self.owners.exchange(updates)
        with self.phase("apply"):
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


class _Phase:
    def __init__(self, timings: Dict[str, float], name: str):
        self.timings, self.name = timings, name

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.timings[self.name] = self.timings.get(self.name, 0.0) + time.perf_counter() - self.t0
