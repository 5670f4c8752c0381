"""``build_optimizer``: the optimizer a run's config asks for, and what the memory planner asks
of it (``state_elements``) without building one. The layouts an optimizer does not support are
refused with the config (``config.rules.optimizer_problem``)."""
from __future__ import annotations

import functools
from typing import Sequence

from ms_llm.compat import float32
from ms_llm.parallel.distributed_optimizer import shard_rows
from ms_llm.parallel.placement import RowShard, grad_replica_dim, placement_of
from .adamw import AdamW
from .base import Optimizer
from .distributed import DistributedOptimizer
from .main_params import MainParams, grad_dtype
from .muon import Muon
from .param_groups import assignment, build_groups

OPTIMIZERS = {"adamw": AdamW, "muon": Muon}


def build_optimizer(named_params: Sequence[tuple], cfg, pstate, jit: bool = False,
                    model_config=None, gather_timer=None) -> Optimizer:
    """The optimizer the config asks for over ``named_params`` (trainable model parameters),
    grouped by rule (``param_groups``): the plain optimizer, wrapped for fp32 main parameters
    when the model is low precision (``training.bf16``), or with
    ``parallel.use_distributed_optimizer`` its dp-sharded form (whose ``grad_sync`` then replaces
    the plain data-parallel all-reduce). ``jit``: the step is compiled (no backward hooks).
    ``model_config``: the architecture (Muon's QKV and grouped-expert views). ``gather_timer``:
    a context manager timing the distributed optimizer's parameter all-gather."""
    t, p = cfg.training, cfg.parallel
    muon = t.optimizer == "muon"
    groups = assignment(build_groups(named_params, muon=muon))
    adam = functools.partial(AdamW, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2),
                             eps=t.adam_eps, weight_decay=t.weight_decay,
                             moments_dtype=t.adam_moments_dtype)
    if muon:
        make = functools.partial(
            Muon, lr=t.lr, momentum=t.muon_momentum, nesterov=t.muon_nesterov,
            weight_decay=t.weight_decay, coefficient_type=t.muon_coefficient_type,
            num_ns_steps=t.muon_num_ns_steps, scale_mode=t.muon_scale_mode,
            extra_scale_factor=t.muon_extra_scale_factor, split_qkv=t.muon_split_qkv,
            tp_mode=t.muon_tp_mode, fp32_matmul_prec=t.muon_fp32_matmul_prec,
            model_config=model_config or cfg.model, groups=groups, adam=adam, pstate=pstate)
    else:
        make = functools.partial(adam, groups=groups)
    if not p.use_distributed_optimizer:
        if any(q.dtype != float32 for _, q in named_params):   # training.bf16
            return MainParams(named_params, make)
        return make(named_params)
    if muon:
        refuse_empty_muon_shards(named_params, groups, pstate)
    overlap = p.ddp_overlap and not jit and pstate.sizes.pp == 1
    return DistributedOptimizer(named_params, pstate, make, bucket_mb=p.ddp_bucket_mb,
                                overlap=overlap, grad_dtype=grad_dtype(cfg),
                                gather_timer=gather_timer)


def refuse_empty_muon_shards(named_params: Sequence[tuple], groups, pstate) -> None:
    """Under the distributed optimizer Muon gathers each matrix from every rank of its group,
    so every rank must hold some rows of it (uneven cuts are fine, an empty one is not built).
    The same answer on every rank (it depends on sizes only), so all of them stop together."""
    for n, q in named_params:
        if groups[n].optimizer != "muon":
            continue
        pl = placement_of(q)
        dim = grad_replica_dim(pl)
        if dim is None:        # FSDP-cut: the distributed optimizer refuses it in one line
            continue
        dim += "_cp" if pstate.sizes.cp > 1 else ""
        g = pstate.group(dim)
        rows, _ = shard_rows(tuple(q.shape), pl, dim, g.size, 0)
        if g.size > 1 and RowShard(rows[0], g.size, g.size - 1).length == 0:
            raise ValueError(f"parallel.use_distributed_optimizer with training.optimizer muon: "
                             f"{n}'s {rows[0]} rows cut over {g.size} ranks (chunks of "
                             f"{RowShard(rows[0], g.size, 0).chunk}) leave a rank none (not built)")


def state_elements(cfg, name: str, shape: Sequence[int]) -> int:
    """fp32 optimizer-state elements per element of parameter ``name`` (global ``shape``) under
    ``cfg``'s optimizer, for ``ms-llm plan`` (fp32 main copies are counted by the planner)."""
    return OPTIMIZERS[cfg.training.optimizer].state_elements(name, tuple(shape))
