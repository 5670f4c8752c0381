"""``build_optimizer``: the optimizer a run's config asks for, built from its registration
(``ms_llm.optim.kinds``: the update rule's factory, its parameter groups and the shards it
refuses), wrapped for fp32 main parameters or the distributed optimizer. What the memory planner
asks of it without building one is ``state_elements`` (the registration's count). The layouts an
optimizer does not support are refused with the config (its registration's ``validate``)."""
from __future__ import annotations

from typing import Sequence

from ms_llm.compat import float32
from .base import Optimizer
from .distributed import DistributedOptimizer
from .kinds import get_optimizer, state_elements  # noqa: F401 (state_elements re-exported)
from .main_params import MainParams, grad_dtype
from .param_groups import assignment, build_groups


def build_optimizer(named_params: Sequence[tuple], cfg, pstate, jit: bool = False,
                    model_config=None, gather_timer=None) -> Optimizer:
    """The optimizer the config asks for over ``named_params`` (trainable model parameters),
    grouped by rule (``param_groups``, the optimizer's ``param_rule``): the plain optimizer,
    wrapped for fp32 main parameters when the model is low precision (``training.bf16``), or
    with ``parallel.use_distributed_optimizer`` its dp-sharded form (whose ``grad_sync`` then
    replaces the plain data-parallel all-reduce). ``jit``: the step is compiled (no backward
    hooks). ``model_config``: the architecture (Muon's QKV and grouped-expert views).
    ``gather_timer``: a context manager timing the distributed optimizer's parameter
    all-gather."""
    t, p = cfg.training, cfg.parallel
    kind = get_optimizer(t.optimizer)
    groups = assignment(build_groups(named_params, kind.rule))
    make = kind.build(cfg, groups, pstate, model_config or cfg.model)
    if not p.use_distributed_optimizer:
        if any(q.dtype != float32 for _, q in named_params):   # training.bf16
            return MainParams(named_params, make)
        return make(named_params)
    if kind.check_shards is not None:
        kind.check_shards(named_params, groups, pstate)
    overlap = p.ddp_overlap and not jit and pstate.sizes.pp == 1
    return DistributedOptimizer(named_params, pstate, make, bucket_mb=p.ddp_bucket_mb,
                                overlap=overlap, grad_dtype=grad_dtype(cfg),
                                gather_timer=gather_timer)
