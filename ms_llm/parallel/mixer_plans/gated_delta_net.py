"""Gated DeltaNet's parallel plan. Tensor parallel: Megatron-Core / MindSpeed's split by heads;
context parallel: the conv inputs and delta-rule state handed rank to rank
(``context_parallel.delta_rule``).

A rank keeps whole key-head groups: ``linear_num_key_heads / tp`` key heads and the
``linear_num_value_heads / linear_num_key_heads`` value heads that read each of them (the GQA-style
grouping of the layer). Every piece of the layer then works on its own heads with no
communication inside:

* ``in_proj_qkvz`` / ``in_proj_ba``: column-parallel; their rows are already grouped per key head
  (``[q k v z]`` and ``[b a]`` of each group), so a rank's groups are one contiguous block;
* ``conv1d.weight`` ``[q; k; v]`` channels: each of the three parts split (placement layout
  ``row_parts``, stored in checkpoints as ``conv1d.weight:q`` / ``:k`` / ``:v``);
* ``A_log`` / ``dt_bias``: per value head, split with their heads;
* the gated RMSNorm normalises each head alone, so it needs no communication; its weight (one
  ``[dv]`` vector shared by all heads) is replicated and its gradient, from this rank's heads
  only, is partial over ``tp``;
* ``out_proj``: row-parallel (all-reduce, or reduce-scatter under sequence parallel).

The model reads its local head counts from the projections' output shapes, so
``ms_llm.models.gated_delta_net`` does not change. Under sequence parallel both input projections
all-gather the sequence shards (two gathers of the same input; one shared gather would halve it).
"""
from __future__ import annotations

from typing import Tuple

import numpy as np

from ms_llm.models.gated_delta_net import GatedDeltaNet
from ..context_parallel.delta_rule import apply_delta_rule_context_parallel
from ..placement import update_placement
from . import MixerPlan, register_plan

__all__ = ["conv_parts", "part_rows", "apply_gated_delta_net_tensor_parallel",
           "validate_gated_delta_net_tp"]


def conv_parts(mixer: GatedDeltaNet) -> Tuple[Tuple[str, int], ...]:
    """The named channel parts of ``conv1d.weight`` with their global sizes."""
    return (("q", mixer.key_dim), ("k", mixer.key_dim), ("v", mixer.value_dim))


def part_rows(parts, rank: int, size: int) -> np.ndarray:
    """Dim-0 rows rank ``rank`` keeps of a tensor made of ``parts``: its slice of each part."""
    rows, base = [], 0
    for _, n in parts:
        k = n // size
        rows.append(base + np.arange(rank * k, (rank + 1) * k))
        base += n
    return np.concatenate(rows)


def validate_gated_delta_net_tp(config, tp: int) -> None:
    """A rank must hold whole key-head groups."""
    hk = config.linear_num_key_heads
    if hk % tp:
        raise ValueError(f"model.linear_num_key_heads ({hk}) is not divisible by "
                         f"parallel.tensor_model_parallel_size ({tp}) (a rank holds whole "
                         f"key-head groups of a Gated DeltaNet layer)")


def apply_gated_delta_net_tensor_parallel(mixer: GatedDeltaNet, tp) -> None:
    """Shard one ``GatedDeltaNet`` in place; ``tp``: the ``TensorParallelContext`` whose
    (LoRA-aware) column / row linears, ``shard`` and ``mark_partial`` make every split, so one
    set of rules holds for every mixer."""
    size, rank = tp.group.size, tp.group.rank
    validate_gated_delta_net_tp(mixer.config, size)
    mixer.in_proj_qkvz = tp.column(mixer.in_proj_qkvz)
    mixer.in_proj_ba = tp.column(mixer.in_proj_ba)
    conv = mixer.conv1d
    conv.weight = tp.shard(conv.weight, 0, rows=part_rows(conv_parts(mixer), rank, size))
    mixer.A_log = tp.shard(mixer.A_log, 0)
    mixer.dt_bias = tp.shard(mixer.dt_bias, 0)
    tp.mark_partial(mixer.norm)
    mixer.out_proj = tp.row(mixer.out_proj)


def _describe(mixer: GatedDeltaNet) -> None:
    """``conv1d.weight``'s ``[q; k; v]`` layout (any tp, so a checkpoint names the parts alike
    under every layout)."""
    update_placement(mixer.conv1d.weight, layout="row_parts", row_parts=conv_parts(mixer))


register_plan("gated_delta_net", MixerPlan(
    tensor_parallel=apply_gated_delta_net_tensor_parallel,
    context_parallel=apply_delta_rule_context_parallel,
    validate_tp=validate_gated_delta_net_tp, describe=_describe))
