"""fp32 main parameters for low-precision models (Megatron's
``Float16OptimizerWithFloat16Params``), around any optimizer.

Under ``training.bf16`` the model's parameters are bf16; the optimizer runs on fp32 *main*
copies and its state is fp32; after each step the mains are rounded (to nearest even) into the
model. fp32 model parameters are their own main parameter (no copy). Checkpoints hold the mains
(``checkpoint_tensor``), so resuming is exact. The distributed optimizer
(``optim.distributed``) keeps fp32 main *shards* instead and uses the helpers here.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

from mindspore import Parameter, Tensor

from ms_llm.compat import F, bfloat16, float32
from ms_llm.ops import cast
from ms_llm.parallel.placement import placement_of, set_placement
from .base import Optimizer, StateTensor, Wrapper

FP32 = 4


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
        out.append(g if g.dtype == float32 else cast(g, float32))
    return tuple(out)


def fp32_main_copy(name: str, p: Parameter) -> Parameter:
    """An fp32 copy of model parameter ``p`` carrying its ``Placement`` (same checkpoint regions,
    grad-sync and norm dims)."""
    main = Parameter(p.astype(float32), name=name, requires_grad=False)
    set_placement(main, placement_of(p))
    return main


class MainParams(Wrapper):
    """``make(named mains)`` (any ``Optimizer``) run on fp32 main copies of the model's
    low-precision parameters; ``params`` are the mains (fp32 gradients go with them)."""

    def __init__(self, named_params: Sequence[tuple],
                 make: Callable[[Sequence[tuple]], Optimizer]):
        self.model_params: List[Parameter] = [p for _, p in named_params]
        self.mains: List[Parameter] = [p if p.dtype == float32 else fp32_main_copy(n, p)
                                       for n, p in named_params]
        self.inner = make([(n, m) for (n, _), m in zip(named_params, self.mains)])
        self._main_of = {id(p): m for p, m in zip(self.model_params, self.mains)}

    def step(self, grads: Sequence[Tensor], lr: Optional[float] = None) -> None:
        self.inner.step(grads_to_fp32(grads), lr)
        self.copy_to_model()

    def copy_to_model(self) -> None:
        """Round the mains into the low-precision model parameters."""
        for p, m in zip(self.model_params, self.mains):
            if m is not p:
                F.copy_(p, cast(m, p.dtype))

    def checkpoint_tensor(self, param: Parameter) -> Optional[Parameter]:
        """The tensor a checkpoint stores as ``param``: its fp32 main parameter."""
        return self._main_of.get(id(param), param)

    def state_tensors(self, param: Parameter) -> List[StateTensor]:
        main = self._main_of.get(id(param))
        return [] if main is None else self.inner.state_tensors(main)

    def load_finished(self) -> None:
        """The main parameters were loaded (``checkpoint_tensor``): round them into the model."""
        self.inner.load_finished()
        self.copy_to_model()

    def state_bytes(self) -> Dict[str, int]:
        out = dict(self.inner.state_bytes())
        out["main_params"] = sum(int(m.size) * FP32 for m, p in zip(self.mains, self.model_params)
                                 if m is not p)
        return out
