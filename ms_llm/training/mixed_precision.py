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
* The optimizer runs on fp32 *main* parameters (``ms_llm.optim.MainParams``, or the
  distributed optimizer's fp32 shards) and its state is fp32; after each step the main
  parameters are rounded into the bf16 model parameters (Megatron's
  ``Float16OptimizerWithFloat16Params``).
* Softmax, cross-entropy and RMSNorm statistics are computed in fp32 by the ops themselves
  (``ms_llm.ops``: fp32 internal math, result cast back to the activation dtype).
* Checkpoints hold the fp32 main parameters (the optimizer's ``checkpoint_tensor``), so resuming
  is exact.

This module holds what ``training.bf16`` sets in the config; the optimizer side is
``ms_llm.optim.main_params``.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

from ms_llm.optim.main_params import grad_dtype, grads_to_fp32, reduces_in_bf16

__all__ = ["apply_to_config", "bf16_problem", "fsdp_param_dtype", "grad_dtype", "grads_to_fp32",
           "model_config_for", "reduces_in_bf16", "same"]

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
    if not p.grad_reduce_in_fp32 and p.fsdp_size > 1 and p.fsdp_reduce_dtype is not None \
            and p.fsdp_reduce_dtype.lower() not in _LOW:
        return ("parallel.grad_reduce_in_fp32", "parallel.fsdp_reduce_dtype"), (
            f"parallel.grad_reduce_in_fp32 false reduces in bf16, but parallel.fsdp_reduce_dtype "
            f"is {p.fsdp_reduce_dtype} (leave it unset)")
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
    gathered-weight and gradient-reduce dtypes (config checks already refused the combinations
    not built)."""
    cfg.model = model_config_for(cfg)
    cfg.parallel.fsdp_param_dtype = fsdp_param_dtype(cfg)
    if reduces_in_bf16(cfg) and cfg.parallel.fsdp_reduce_dtype is None:
        cfg.parallel.fsdp_reduce_dtype = "bfloat16"


def same(grads):
    """The gradients unchanged (fp32 runs: the jit graph gets no casts)."""
    return grads
