"""bf16 mixed precision (``training.bf16``), Megatron's ``--bf16`` recipe.

* Model parameters and activations are bf16 (``model.params_dtype`` becomes ``bfloat16``); under
  FSDP the sharded parameters stay fp32 (they *are* the main parameters) and the gathered copies
  are bf16 (``parallel.fsdp_param_dtype``), torch FSDP2's MixedPrecisionPolicy.
* Gradients are accumulated over micro-batches and reduced across ranks in fp32
  (``parallel.grad_reduce_in_fp32``, default true), or with ``grad_reduce_in_fp32: false`` in
  bf16, Megatron's behaviour: the gradient buffers take the parameters' dtype, micro-batch sums
  and the data-parallel all-reduce / reduce-scatter (FSDP's ``fsdp_reduce_dtype`` too) run in
  bf16, and the reduced gradients become fp32 only for the norm, clipping and AdamW (Megatron's
  copy of the model grads into the fp32 main grads). Half the gradient communication and
  buffer bytes, for one more bf16 rounding of every gradient per micro-batch sum and reduction.
* AdamW runs on fp32 *main* parameters (:class:`MainParamsAdamW` here, or the distributed
  optimizer's fp32 shards) and its moments are fp32; after each step the main parameters are
  rounded into the bf16 model parameters (Megatron's ``Float16OptimizerWithFloat16Params``).
* Softmax, cross-entropy and RMSNorm statistics are computed in fp32 by the ops themselves
  (``ms_llm.ops``: fp32 internal math, result cast back to the activation dtype).
* Checkpoints hold the fp32 main parameters (``checkpoint_tensor``), so resuming is exact.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence

from mindspore import Parameter, Tensor

from ms_llm.compat import F, bfloat16, float32
from ms_llm.parallel.placement import placement_of, set_placement
from .optimizer import AdamW, WrapsAdamW



def model_config_for(cfg):
    """The model config a bf16 run builds: bf16 parameters, except under FSDP, whose fp32 shards
    are the main parameters (the gathered weights are bf16 through ``fsdp_param_dtype``)."""
    if not cfg.training.bf16 or cfg.parallel.fsdp_size > 1:
        return cfg.model
    return cfg.model.replace(params_dtype="bfloat16")


def fsdp_param_dtype(cfg) -> Optional[str]:
    """``parallel.fsdp_param_dtype`` as a bf16 run needs it (gathered weights in bf16)."""
    p = cfg.parallel
    return "bfloat16" if cfg.training.bf16 and p.fsdp_param_dtype is None else p.fsdp_param_dtype


def resolved(cfg):
    """The run config a ``training.bf16`` trainer runs: the model's parameter dtype and FSDP's
    gathered-weight and gradient-reduce dtypes set (a derived copy; the rules already refused
    the combinations not built)."""
    if not cfg.training.bf16:
        return cfg
    reduce_dtype = cfg.parallel.fsdp_reduce_dtype
    if reduces_in_bf16(cfg) and reduce_dtype is None:
        reduce_dtype = "bfloat16"
    parallel = dataclasses.replace(cfg.parallel, fsdp_param_dtype=fsdp_param_dtype(cfg),
                                   fsdp_reduce_dtype=reduce_dtype)
    return cfg.replace(model=model_config_for(cfg), parallel=parallel)


def reduces_in_bf16(cfg) -> bool:
    """``training.bf16`` with ``parallel.grad_reduce_in_fp32: false``: gradients are summed over
    micro-batches and reduced across ranks in bf16."""
    return bool(cfg.training.bf16 and not cfg.parallel.grad_reduce_in_fp32)


def grad_dtype(cfg):
    """The dtype gradients are accumulated and reduced in (bf16 or fp32)."""
    return bfloat16 if reduces_in_bf16(cfg) else float32


def grads_to_fp32(grads: Sequence[Tensor]) -> tuple:
    """Low-precision gradients as fp32 (a loop, not a generator: also parsed by mindspore.jit)."""
    out = []
    for g in grads:
        out.append(g if g.dtype == float32 else g.astype(float32))
    return tuple(out)


def same(grads):
    """The gradients unchanged (fp32 runs: the jit graph gets no casts)."""
    return grads


def fp32_main_copy(name: str, p: Parameter) -> Parameter:
    """An fp32 copy of model parameter ``p`` carrying its ``Placement`` (same checkpoint regions,
    grad-sync and norm dims)."""
    main = Parameter(p.astype(float32), name=name, requires_grad=False)
    set_placement(main, placement_of(p))
    return main


class MainParamsAdamW(WrapsAdamW):
    """AdamW on fp32 main copies of the model's low-precision parameters.

    ``params`` are the main parameters (what ``step`` takes gradients for, fp32 ones; their
    placements are the model parameters'). fp32 model parameters are their own main parameter
    (no copy). After every step, and after a checkpoint load, the main parameters are rounded
    (to nearest even) into the model parameters."""

    def __init__(self, named_params: Sequence[tuple], **kw):
        self.model_params: List[Parameter] = [p for _, p in named_params]
        self.mains: List[Parameter] = [p if p.dtype == float32 else fp32_main_copy(n, p)
                                       for n, p in named_params]
        self.inner = AdamW([(n, m) for (n, _), m in zip(named_params, self.mains)], **kw)
        self.params = self.inner.params
        self.exp_avg, self.exp_avg_sq = self.inner.exp_avg, self.inner.exp_avg_sq
        self._main_of = {id(p): m for p, m in zip(self.model_params, self.mains)}

    def step(self, grads: Sequence[Tensor], lr: Optional[float] = None) -> None:
        self.inner.step(grads_to_fp32(grads), lr)
        self.copy_to_model()

    def copy_to_model(self) -> None:
        for p, m in zip(self.model_params, self.mains):
            if m is not p:
                F.copy_(p, m.astype(p.dtype))

    def checkpoint_tensor(self, param: Parameter) -> Optional[Parameter]:
        """The tensor a checkpoint stores as ``param``: its fp32 main parameter."""
        return self._main_of.get(id(param), param)

    def state_tensors(self, param: Parameter) -> list:
        main = self._main_of.get(id(param))
        return [] if main is None else self.inner.state_tensors(main)

    def load_finished(self) -> None:
        """The main parameters were loaded (``checkpoint_tensor``): round them into the model."""
        self.copy_to_model()

    def state_bytes(self) -> Dict[str, int]:
        out = self.inner.state_bytes()
        out["main_params"] = sum(int(m.size) * 4 for m, p in zip(self.mains, self.model_params)
                                 if m is not p)
        return out
