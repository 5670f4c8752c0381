"""AdamW with torch.optim.AdamW's exact update, on MindSpore's fused ``AdamWeightDecay`` kernel.

``mindspore.experimental.optim.AdamW`` matches torch but costs ~480 ms per step on 44 M
parameters on CPU (one small op per tensor per term); the fused ``ops.AdamWeightDecay`` primitive
costs ~135 ms but has no bias correction. Bias correction folds into its scalar inputs exactly:

    m_hat / (sqrt(v_hat) + eps) = (sqrt(bc2)/bc1) * m / (sqrt(v) + eps*sqrt(bc2))

so lr' = lr*sqrt(bc2)/bc1, eps' = eps*sqrt(bc2), decay' = wd*lr/lr' gives
``p -= lr*m_hat/(sqrt(v_hat)+eps) + lr*wd*p``, which is torch's decoupled update. A group's
``lr_mult`` scales lr' (and so both terms), its ``wd_mult`` the decay. Parameters are fp32
master weights (the kernel has no bf16 CPU form; ``main_params.MainParams`` wraps bf16 models).

``moments_dtype`` bfloat16 is MindSpeed-LLM's O2 optimizer (``--o2-optimizer``,
``training.adam_moments_dtype``): ``exp_avg``/``exp_avg_sq`` are *stored* in bf16 (4 bytes per
parameter instead of 8) and, as MindSpeed's ``O2AdamW`` does, upcast to fp32 for each tensor's
update and rounded (to nearest even) back afterwards; the arithmetic is unchanged.

On CPU the same arithmetic runs in ms-llm's C kernel (``cpu_kernels.adamw_update``: in place,
on the worker's threads; MindSpore's kernel is single-threaded, ~250 ms of a ~3.4 s step of the
~55M model) when every parameter and moment owns its storage; otherwise MindSpore's kernel.
"""
from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np
from mindspore import Parameter, Tensor, ops

from ms_llm.compat import F, float32, is_cpu, to_ms_dtype, zeros
from ms_llm.compat.functional import owns_storage
from ms_llm.parallel.placement import placement_of
from .base import StateTensor
from .param_groups import ParamGroup, assignment, build_groups

FP32 = 4


class AdamW:
    """Decoupled-weight-decay Adam over ``named_params`` (fp32), grouped by rule
    (``param_groups``) unless ``groups`` (name -> group, e.g. computed on the model's
    parameters by a wrapper holding shards of them) is given."""
    grad_sync = None

    def __init__(self, named_params: Sequence[tuple], lr: float = 1e-3,
                 betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 groups: Optional[Mapping[str, ParamGroup]] = None,
                 moments_dtype: str = "float32"):
        self.names = [n for n, _ in named_params]
        self.params: List[Parameter] = [p for _, p in named_params]
        for n, p in named_params:
            if p.dtype != float32:
                raise TypeError(f"AdamW: parameter {n} is {p.dtype}; fp32 master weights required")
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        if groups is None:
            self.groups = build_groups(named_params, "adamw")    # its registered name
            groups = assignment(self.groups)
        else:
            self.groups = list({id(g): g for g in (groups[n] for n in self.names)}.values())
        self.lr_mult = [groups[n].lr_mult for n in self.names]
        self.wd_mult = [groups[n].wd_mult for n in self.names]
        # State is created eagerly so a checkpoint load always has somewhere to go.
        self.moments_dtype = to_ms_dtype(moments_dtype)
        md = self.moments_dtype
        self.exp_avg = [Parameter(zeros(p.shape, dtype=md), name=f"exp_avg.{n}",
                                  requires_grad=False) for n, p in named_params]
        self.exp_avg_sq = [Parameter(zeros(p.shape, dtype=md), name=f"exp_avg_sq.{n}",
                                     requires_grad=False) for n, p in named_params]
        self._slot = {id(p): i for i, p in enumerate(self.params)}
        self.step_count = 0
        self._kernel = ops.AdamWeightDecay()
        self._threads = _cpu_kernel_threads(self.params + self.exp_avg + self.exp_avg_sq)

    def step(self, grads: Sequence[Tensor], lr: Optional[float] = None) -> None:
        lr = self.lr if lr is None else lr
        self.step_count += 1
        b1, b2 = self.betas
        bc1 = 1.0 - b1 ** self.step_count
        bc2 = 1.0 - b2 ** self.step_count
        lr_k = lr * math.sqrt(bc2) / bc1
        eps_k = self.eps * math.sqrt(bc2)
        decay_k = self.weight_decay * lr / lr_k if lr_k > 0 else 0.0
        if self._threads:
            from ms_llm.ops import cast, cpu_kernels
            hyper: Dict[tuple, Tensor] = {}
            for p, m, v, g, lm, wm in zip(self.params, self.exp_avg, self.exp_avg_sq, grads,
                                          self.lr_mult, self.wd_mult):
                if (lm, wm) not in hyper:
                    hyper[(lm, wm)] = Tensor(np.array([lr_k * lm, b1, b2, eps_k, decay_k * wm],
                                                      np.float32))
                m32, v32 = self._fp32(m, wrap=False), self._fp32(v, wrap=False)
                if not cpu_kernels.adamw_update(p, m32, v32, cast(g, float32),
                                                hyper[(lm, wm)], self._threads):
                    raise RuntimeError("AdamW: the CPU kernels were turned off after the "
                                       "optimizer chose them (runtime.aot_kernels)")
                self._store(m, m32, v, v32)
            return
        for p, m, v, g, lm, wm in zip(self.params, self.exp_avg, self.exp_avg_sq, grads,
                                      self.lr_mult, self.wd_mult):
            m32, v32 = self._fp32(m), self._fp32(v)
            self._kernel(p, m32, v32, lr_k * lm, b1, b2, eps_k, decay_k * wm, g)
            self._store(m, m32, v, v32)

    @staticmethod
    def _fp32(moment: Parameter, wrap: bool = True):
        """The moment itself (fp32), or an fp32 working copy of a bf16 one (O2). MindSpore's
        kernel updates Parameters only (``wrap``); ms-llm's C kernel takes the plain tensor,
        whose memory the pool reuses tensor after tensor (wrapped copies stayed resident:
        +0.46 GB after a step over 6 x 4M elements, against 0.07 GB unwrapped)."""
        if moment.dtype == float32:
            return moment
        from ms_llm.ops import cast
        m32 = cast(moment, float32)
        return Parameter(m32, requires_grad=False) if wrap else m32

    @staticmethod
    def _store(m, m32, v, v32) -> None:
        """Round O2's fp32 working moments back into their bf16 storage (nothing for fp32)."""
        if m32 is not m:
            from ms_llm.ops import cast
            F.copy_(m, cast(m32, m.dtype))
            F.copy_(v, cast(v32, v.dtype))

    def state_tensors(self, param: Parameter) -> List[StateTensor]:
        """``param``'s moments, with the parameter's own placement (they are split as it is)."""
        i = self._slot.get(id(param))
        if i is None:
            return []
        pl = placement_of(param)
        return [StateTensor("optimizer.exp_avg.", self.exp_avg[i], pl),
                StateTensor("optimizer.exp_avg_sq.", self.exp_avg_sq[i], pl)]

    def checkpoint_tensor(self, param: Parameter) -> Optional[Parameter]:
        """The parameters are the master weights: a checkpoint stores ``param`` itself."""
        return param

    def load_finished(self) -> None:
        """Called after a checkpoint load (the parameters are the master weights: nothing)."""

    def state_bytes(self) -> Dict[str, int]:
        """This rank's optimizer-state bytes (the parameters are the master weights)."""
        width = self.exp_avg[0].itemsize if self.exp_avg else FP32
        return {"exp_avg+exp_avg_sq": sum(int(m.size) * width * 2 for m in self.exp_avg),
                "main_params": 0}

    def state_dict(self) -> Dict[str, np.ndarray]:
        out = {"step": np.array(self.step_count, np.int64)}
        for n, m, v in zip(self.names, self.exp_avg, self.exp_avg_sq):   # bf16 (O2): exact
            out[f"exp_avg.{n}"] = m.astype(float32).asnumpy()
            out[f"exp_avg_sq.{n}"] = v.astype(float32).asnumpy()
        return out

    def load_state_dict(self, state: Dict[str, np.ndarray], source: str = "optimizer state"
                        ) -> None:
        for n, m, v in zip(self.names, self.exp_avg, self.exp_avg_sq):
            for key, dst in ((f"exp_avg.{n}", m), (f"exp_avg_sq.{n}", v)):
                if key not in state:
                    raise KeyError(f"{source}: missing {key!r}")
                dst.set_data(Tensor(np.asarray(state[key], np.float32)).astype(dst.dtype))
        self.step_count = int(state["step"])


def _cpu_kernel_threads(tensors: Sequence[Tensor]) -> int:
    """Threads for ms-llm's CPU AdamW kernel, or 0 to keep MindSpore's (not on CPU, kernels
    off or unbuilt, or a tensor that is a view the kernel must not write through)."""
    from ms_llm.ops import aot_enabled
    if not is_cpu() or not aot_enabled() or not all(owns_storage(t) for t in tensors):
        return 0
    from ms_llm.ops.cpu_kernels import blas_threads
    return max(1, blas_threads())
