"""Per-rank parameter shapes of a layout, without building the full-size model's weights.

``ms-llm plan`` must count exactly what training holds, with training's own sharding rules and
never a copy of them. It does it in two passes:

1. the full-size model is built under ``compat.nn.shape_only()`` (parameters with shapes, no
   storage, like torch's meta device) and ``describe_layouts`` records its storage layouts: the
   exact global parameter names and shapes;
2. a *twin* of the model, the same config with every width shrunk (same layers, heads, query
   groups, experts, layer pattern), is really built and run through ``parallelize_model`` with
   this rank's coordinates (``PlanGroup``: the mesh's groups without a communicator). What that
   leaves on each parameter is its ``Placement`` record: which mesh dims shard which tensor dim,
   partial dims, global indices (pipeline stage, expert).

Each of this rank's twin parameters is then mapped to its global name; its record, given the
full-size global shape, yields this rank's region through ``placement.checkpoint_regions``, the
function checkpoints use, so the chunk rule, GLU halves and expert row blocks come from one place.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

import numpy as np

from ms_llm.compat import nn
from ms_llm.models.config import TransformerConfig
from .comm.groups import ProcessGroup
from .placement import Mesh, Placement, checkpoint_name, checkpoint_regions, placement_of
from .state import ParallelSizes, ParallelState


@dataclass(frozen=True)
class PlanGroup(ProcessGroup):
    """A mesh group seen from rank ``me`` (no communicator: planning never communicates)."""
    me: int = 0

    @property
    def rank(self) -> int:
        return self.ranks.index(self.me) if self.me in self.ranks else -1


def plan_state(sizes: ParallelSizes, rank: int) -> ParallelState:
    """``ParallelState`` of ``rank`` with communicator-free groups (same rank order)."""
    st = ParallelState(sizes, rank=rank)
    for dim in ParallelState.GROUP_DIMS:
        st.groups[dim] = PlanGroup(tuple(st.ranks_along(dim)), None, me=rank)
    # steps that would open communicators and hold no parameters (context parallel's attention
    # swap, which makes its ring and Ulysses groups) are skipped for this state
    st.plan_only = True
    return st


@dataclass(frozen=True)
class LocalParam:
    """One parameter as this rank holds it."""
    name: str                  # global (checkpoint) name
    numel: int                 # elements this rank stores
    full_numel: int            # elements of the whole tensor
    itemsize: int              # bytes per element
    trainable: bool
    expert: bool               # sharded over expert parallel (its grads sync over edp)
    fsdp: bool                 # sharded by FSDP (gathered for compute)
    unit: Optional[str]        # FSDP unit it belongs to (None: not FSDP-sharded)


def full_shapes(model_cfg: TransformerConfig, noop_layers=()
                ) -> Dict[str, Tuple[Tuple[int, ...], Placement, int]]:
    """Global name -> (shape, layout record, itemsize) of the full-size model, built without
    storage (``noop_layers``: ``parallel.noop_layers``, layers that hold nothing)."""
    from ms_llm.models.gpt import GPTModel
    from .parallelize import describe_layouts
    from .pipeline.stages import apply_noop_layers
    with nn.shape_only():
        model = GPTModel(model_cfg)
    apply_noop_layers(model, noop_layers)
    describe_layouts(model)
    return {n: (tuple(p.shape), placement_of(p), p.itemsize)
            for n, p in model.parameters_and_names()}


def twin_config(c: TransformerConfig, tp: int, unit: int = 2) -> TransformerConfig:
    """The model with every width shrunk to a few elements that every split still divides
    (``unit``: a multiple every width must keep, e.g. MXFP8's 32-element blocks); counts
    (layers, heads, groups, experts, pattern) unchanged, so the module tree and every layout
    rule are the same."""
    from ms_llm.models.mixers import mixers_used
    small = dict(hidden_size=4 * unit, kv_channels=_twin_head_dim(c.rotary_percent, unit),
                 ffn_hidden_size=unit * tp, padded_vocab_size=unit * tp)
    for kind in mixers_used(c):              # a token mixer's own widths (MLA's ranks, ...)
        small.update(kind.twin_widths(c, unit))
    if c.num_moe_experts:
        small["moe_ffn_hidden_size"] = unit * tp
    if c.moe_shared_expert_intermediate_size:
        small["moe_shared_expert_intermediate_size"] = unit * tp
    return dataclasses.replace(c, **small)


def _twin_head_dim(rotary_percent: float, unit: int) -> int:
    """The twin's head dim: the smallest multiple of ``unit`` of which RoPE rotates an even,
    whole number of dims (``rotary_percent`` 0.5 of 2 would rotate one)."""
    for k in range(1, 65):
        rotated = unit * k * rotary_percent
        if rotated == int(rotated) and int(rotated) % 2 == 0 and rotated > 0:
            return unit * k
    raise ValueError(f"plan: no head dim up to {64 * unit} rotates an even number of dims at "
                     f"model.rotary_percent {rotary_percent}")


def _twin_run_config(cfg, model_cfg: TransformerConfig):
    """The run config the twin is parallelized with: the same layout, recompute off (it only
    marks modules) and no jit."""
    return cfg.replace(model=model_cfg, training=dataclasses.replace(
        cfg.training, recompute_granularity=None, recompute_method=None,
        recompute_num_layers=None, recompute_norm=False, jit=False))


def rank_params(cfg, model_cfg: TransformerConfig, sizes: ParallelSizes, rank: int,
                shapes: Optional[dict] = None) -> List[LocalParam]:
    """Every parameter ``rank`` holds under ``cfg.parallel``'s layout, full-size."""
    from ms_llm.compat import manual_seed
    from ms_llm.models.gpt import GPTModel
    from .parallelize import parallelize_model
    from .tensor_parallel import validate_tp
    shapes = full_shapes(model_cfg) if shapes is None else shapes
    if sizes.tp > 1:
        validate_tp(model_cfg, sizes.tp)
    twin_cfg = twin_config(model_cfg, sizes.tp, 32 if cfg.quant.recipe else 2)
    manual_seed(0)
    twin = GPTModel(twin_cfg)
    pstate = plan_state(sizes, rank)
    par = parallelize_model(twin, _twin_run_config(cfg, twin_cfg), pstate)
    mesh = Mesh.of(pstate)
    units = _fsdp_units(par) if par.fsdp else {}
    out, seen = [], set()
    for name, p in par.named_params:
        pl = placement_of(p)
        gname = checkpoint_name(name, pl)
        if gname not in shapes:
            raise ValueError(f"plan: parameter {gname} of the parallelized model is not in the "
                             f"full model")
        if gname in seen:
            continue
        seen.add(gname)
        shape, layout, itemsize = shapes[gname]
        full_pl = replace(pl, global_shape=shape, layout=layout.layout, row_width=layout.row_width,
                          row_parts=layout.row_parts)
        numel = sum(int(np.prod(r.sizes)) for r in checkpoint_regions(name, shape, full_pl, mesh))
        out.append(LocalParam(gname, numel, int(np.prod(shape)), itemsize, bool(p.requires_grad),
                              pl.sharded_over("ep"), pl.dp_cut is not None, units.get(id(p))))
    return out


def _fsdp_units(par) -> Dict[int, str]:
    """id(parameter) -> name of the FSDP unit that gathers it (each unit's own parameters)."""
    from .fsdp.fully_shard import FSDPModule
    out = {}
    for c, root in enumerate(par.chunks or [par.model]):
        for uname, cell in root.cells_and_names():
            if isinstance(cell, FSDPModule):
                for fp in cell._fsdp_state.fparams:
                    out[id(fp.param)] = f"{c}:{uname or 'root'}"
    return out
