"""``build_optimizer``: the optimizer a run's config asks for, and what the memory planner asks
of it (``state_elements``) without building one."""
from __future__ import annotations

import functools
from typing import Sequence

from ms_llm.compat import float32
from .adamw import AdamW
from .base import Optimizer
from .distributed import DistributedOptimizer
from .main_params import MainParams, grad_dtype
from .param_groups import assignment, build_groups

OPTIMIZERS = {"adamw": AdamW}


def build_optimizer(named_params: Sequence[tuple], cfg, pstate, jit: bool = False) -> Optimizer:
    """The optimizer the config asks for over ``named_params`` (trainable model parameters),
    grouped by rule (``param_groups``): the plain optimizer, wrapped for fp32 main parameters
    when the model is low precision (``training.bf16``), or with
    ``parallel.use_distributed_optimizer`` its dp-sharded form (whose ``grad_sync`` then replaces
    the plain data-parallel all-reduce). ``jit``: the step is compiled (no backward hooks)."""
    t, p = cfg.training, cfg.parallel
    groups = build_groups(named_params)
    make = functools.partial(AdamW, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                             weight_decay=t.weight_decay, groups=assignment(groups))
    if not p.use_distributed_optimizer:
        if any(q.dtype != float32 for _, q in named_params):   # training.bf16
            return MainParams(named_params, make)
        return make(named_params)
    overlap = p.ddp_overlap and not jit and pstate.sizes.pp == 1
    return DistributedOptimizer(named_params, pstate, make, bucket_mb=p.ddp_bucket_mb,
                                overlap=overlap, grad_dtype=grad_dtype(cfg))


def state_elements(cfg, name: str, shape: Sequence[int]) -> int:
    """fp32 optimizer-state elements per element of parameter ``name`` (global ``shape``) under
    ``cfg``'s optimizer, for ``ms-llm plan`` (fp32 main copies are counted by the planner)."""
    return OPTIMIZERS[cfg.training.optimizer].state_elements(name, tuple(shape))
