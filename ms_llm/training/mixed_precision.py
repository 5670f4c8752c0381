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

import dataclasses
from typing import Optional

from ms_llm.optim.main_params import grad_dtype, grads_to_fp32, reduces_in_bf16

__all__ = ["fsdp_param_dtype", "grad_dtype", "grads_to_fp32", "model_config_for",
           "reduces_in_bf16", "resolved", "same"]


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


def same(grads):
    """The gradients unchanged (fp32 runs: the jit graph gets no casts)."""
    return grads
