"""``ms-llm plan`` with many small experts: build the shape-only model and its parallelized twin
with fewer experts, then unfold the result to the real count.

Why: building ``local_experts`` modules dominates planning a 512-expert model (Qwen3-Next 80B:
48 x 512 expert MLPs, built twice, ~4 minutes of Python object creation for what are identical
modules). Experts are interchangeable for memory: expert ``e`` of the folded model (``E'``
experts, ``f = E / E'``) stands for the real experts ``e f .. e f + f - 1``. Expert parallel
cuts both counts into the same ``ep`` contiguous blocks (rank ``r``: folded ``[r E'/ep, (r+1)
E'/ep)`` = real ``[r E/ep, (r+1) E/ep)``), so each folded expert parameter a rank holds becomes
``f`` real ones with the same sizes and flags, and the router's ``[E', H]`` / ``[E']`` rows are
scaled by ``f``. Folding applies to per-expert modules (not ``moe_grouped_gemm``, already two
tensors per layer) and routers without expert groups; otherwise the model is built as is.
tests/planning/test_qwen3_next_plan.py checks that a folded plan equals the unfolded one exactly.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Tuple

from ms_llm.models.config import TransformerConfig
from .plan_shapes import LocalParam

_EXPERT = re.compile(r"^(.*\.local_experts\.)(\d+)(\..*)$")
_ROUTER = re.compile(r"\.router\.(weight|expert_bias)$")
FOLD_ABOVE = 32          # fold models with more experts than this


def fold_experts(c: TransformerConfig, ep: int) -> Tuple[TransformerConfig, int]:
    """(the config to build, factor ``f``): the fewest experts that are a multiple of ``ep``,
    at least ``moe_router_topk``, and divide the real count; ``f`` 1 when nothing is folded."""
    e = c.num_moe_experts or 0
    if (c.mlp_type != "moe" or e <= FOLD_ABOVE or c.moe_grouped_gemm
            or (c.moe_router_num_groups or 1) > 1):
        return c, 1
    for small in range(max(ep, c.moe_router_topk), e + 1):
        if small % ep == 0 and e % small == 0:
            return dataclasses.replace(c, num_moe_experts=small), e // small
    return c, 1


def unfold_shapes(shapes: Dict[str, tuple], f: int) -> Dict[str, tuple]:
    """``full_shapes`` of the folded model -> the real model's (names and shapes)."""
    if f == 1:
        return shapes
    out = {}
    for name, (shape, layout, itemsize) in shapes.items():
        m = _EXPERT.match(name)
        if m:
            for j in range(f):
                out[f"{m[1]}{int(m[2]) * f + j}{m[3]}"] = (shape, layout, itemsize)
        elif _ROUTER.search(name):
            out[name] = ((shape[0] * f,) + tuple(shape[1:]), layout, itemsize)
        else:
            out[name] = (shape, layout, itemsize)
    return out


def unfold_params(params: List[LocalParam], f: int) -> List[LocalParam]:
    """``rank_params`` of the folded model -> the real model's on the same rank."""
    if f == 1:
        return params
    out = []
    for p in params:
        m = _EXPERT.match(p.name)
        if m:
            out += [dataclasses.replace(p, name=f"{m[1]}{int(m[2]) * f + j}{m[3]}")
                    for j in range(f)]
        elif _ROUTER.search(p.name):
            out.append(dataclasses.replace(p, numel=p.numel * f, full_numel=p.full_numel * f))
        else:
            out.append(p)
    return out
