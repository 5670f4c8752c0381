"""bf16 mixed precision (``training.bf16``), Megatron's ``--bf16`` recipe.

* Model parameters and activations are bf16 (``model.params_dtype`` becomes ``bfloat16``); under
  FSDP the sharded parameters stay fp32 (they *are* the main parameters) and the gathered copies
  are bf16 (``parallel.fsdp_param_dtype``), torch FSDP2's MixedPrecisionPolicy.
* Gradients are accumulated over micro-batches and reduced across ranks in fp32
  (``parallel.grad_reduce_in_fp32``, the only setting built).
* AdamW runs on fp32 *main* parameters (:class:`MainParamsAdamW` here, or the distributed
  optimizer's fp32 shards) and its moments are fp32; after each step the main parameters are
  rounded into the bf16 model parameters (Megatron's ``Float16OptimizerWithFloat16Params``).
* Softmax, cross-entropy and RMSNorm statistics are computed in fp32 by the ops themselves
  (``ms_llm.ops``: fp32 internal math, result cast back to the activation dtype).
* Checkpoints hold the fp32 main parameters (``checkpoint_tensor``), so resuming is exact.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from mindspore import Parameter, Tensor

from ms_llm.compat import F, float32
from ms_llm.parallel.placement import placement_of, set_placement
from .optimizer import AdamW, WrapsAdamW

Problem = Optional[Tuple[Sequence[str], str]]
_LOW = ("bfloat16", "bf16")


def bf16_problem(cfg) -> Problem:
    """Combinations with ``training.bf16`` that are not built (config.validate names the keys)."""
    t, p, m = cfg.training, cfg.parallel, cfg.model
    if not t.bf16:
        return None
    if m.params_dtype not in ("float32", "fp32") + _LOW:
        return ("training.bf16", "model.params_dtype"), (
            f"training.bf16 with model.params_dtype {m.params_dtype}: leave params_dtype at "
            f"float32 (bf16 sets the model's dtype itself)")
    if not p.grad_reduce_in_fp32:
        return ("training.bf16", "parallel.grad_reduce_in_fp32"), (
            "training.bf16 with parallel.grad_reduce_in_fp32 false is not built (gradients are "
            "accumulated and reduced in fp32)")
    if p.fsdp_size > 1 and p.fsdp_param_dtype is not None \
            and p.fsdp_param_dtype.lower() not in _LOW:
        return ("training.bf16", "parallel.fsdp_param_dtype"), (
            f"training.bf16 with parallel.fsdp_param_dtype {p.fsdp_param_dtype}: bf16 gathers "
            f"bf16 weights (leave fsdp_param_dtype unset)")
    return None


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


def apply_to_config(cfg) -> None:
    """What ``training.bf16`` sets for the trainer: the model's parameter dtype and FSDP's
    gathered-weight dtype (config checks already refused the combinations not built)."""
    cfg.model = model_config_for(cfg)
    cfg.parallel.fsdp_param_dtype = fsdp_param_dtype(cfg)


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
