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
Non-matrix parameters (embeddings, output layer, norms, biases, router) take ``AdamW`` with the
``adam_*`` options. Momentum buffers are checkpointed as ``optimizer.momentum_buffer.<name>``.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
from mindspore import Parameter, Tensor, mint

from ms_llm.compat import F, float32, zeros
from ms_llm.parallel.placement import placement_of
from .adamw import AdamW
from .base import Optimizer, StateTensor
from .newton_schulz import coefficient_schedule, newton_schulz, scale_factor
from .param_groups import ParamGroup, assignment, build_groups, is_muon_matrix

FP32 = 4


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
        f, h = c.moe_ffn_hidden_size, c.hidden_size
        if name.endswith("weight1"):              # [H, E*2F] viewed [E, H, 2F]
            return ("experts", shape[1] // (2 * f), h, 2 * f)
        return ("experts", shape[0] // f, f, h)   # [E*F, H] viewed [E, F, H]
    return ("plain",)


class Muon:
    """Muon over the ``muon`` group's parameters, ``adam(named, groups)`` over the rest."""
    grad_sync = None

    def __init__(self, named_params: Sequence[tuple], lr: float = 1e-3, momentum: float = 0.95,
                 nesterov: bool = False, weight_decay: float = 0.01,
                 coefficient_type: str = "quintic", num_ns_steps: int = 5,
                 scale_mode: str = "spectral", extra_scale_factor: float = 1.0,
                 split_qkv: bool = True, model_config=None,
                 groups: Optional[Mapping[str, ParamGroup]] = None,
                 adam: Optional[Callable[..., Optimizer]] = None):
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
        self.views = {i: matrix_view(self.names[i], tuple(self.params[i].shape), model_config,
                                     split_qkv) for i in self.muon_idx}
        self.lr_mult = {i: groups[self.names[i]].lr_mult for i in self.muon_idx}
        self.wd_mult = {i: groups[self.names[i]].wd_mult for i in self.muon_idx}
        self.momentum_buffer = {i: Parameter(zeros(self.params[i].shape), requires_grad=False,
                                             name=f"momentum_buffer.{self.names[i]}")
                                for i in self.muon_idx}
        self._slot = {id(p): i for i, p in enumerate(self.params)}

    @property
    def step_count(self) -> int:
        return self.adam.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.adam.step_count = value

    # ------------------------------------------------------------------ the update
    def orthogonalize(self, i: int, u: Tensor) -> Tensor:
        """The scaled Newton-Schulz update of parameter ``i`` from its momentum ``u``."""
        view, s = self.views[i], self.extra_scale_factor
        if view[0] == "qkv":
            ng, rows = view[1], view[2]
            h = u.shape[-1]
            parts = mint.split(u.reshape(ng, sum(rows), h), rows, dim=1)
            out = []
            for part in parts:
                m = part.reshape(-1, h)
                o = newton_schulz(m, self.schedule)
                out.append((o * (scale_factor(m.shape[0], h, self.scale_mode) * s))
                           .reshape(ng, -1, h))
            return mint.cat(out, dim=1).reshape(u.shape)
        if view[0] == "experts":
            e, fan_in, fan_out = view[1:]
            o = newton_schulz(u.reshape(e, fan_in, fan_out), self.schedule)
            return (o * (scale_factor(fan_out, fan_in, self.scale_mode) * s)).reshape(u.shape)
        o = newton_schulz(u, self.schedule)
        return o * (scale_factor(u.shape[0], u.shape[1], self.scale_mode) * s)

    def step(self, grads: Sequence[Tensor], lr: Optional[float] = None) -> None:
        lr = self.lr if lr is None else lr
        self.adam.step([grads[i] for i in self.adam_idx], lr)
        m = self.momentum
        for i in self.muon_idx:
            p, g, buf = self.params[i], grads[i], self.momentum_buffer[i]
            lr_p = lr * self.lr_mult[i]
            decay = lr_p * self.weight_decay * self.wd_mult[i]
            if decay:
                F.copy_(p, p * (1.0 - decay))
            F.copy_(buf, buf + (g - buf) * (1.0 - m))
            u = g + (buf - g) * m if self.nesterov else buf
            F.copy_(p, p - self.orthogonalize(i, u) * lr_p)

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
