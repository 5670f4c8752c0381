"""Tensor parallel of Gated DeltaNet layers (Megatron-Core / MindSpeed's split by heads).

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
from .placement import update_placement

__all__ = ["conv_parts", "describe_gated_delta_net", "apply_gated_delta_net_tensor_parallel",
           "validate_gated_delta_net_tp"]


def conv_parts(mixer: GatedDeltaNet) -> Tuple[Tuple[str, int], ...]:
    """The named channel parts of ``conv1d.weight`` with their global sizes."""
    return (("q", mixer.key_dim), ("k", mixer.key_dim), ("v", mixer.value_dim))


def describe_gated_delta_net(model) -> None:
    """Record ``conv1d.weight``'s ``[q; k; v]`` layout on every Gated DeltaNet (any tp, so a
    checkpoint names the parts alike under every layout)."""
    for _, cell in model.cells_and_names():
        if isinstance(cell, GatedDeltaNet):
            update_placement(cell.conv1d.weight, layout="row_parts", row_parts=conv_parts(cell))


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


def apply_gated_delta_net_tensor_parallel(mixer: GatedDeltaNet, group, column, row, shard,
                                          mark_partial, sequence_parallel: bool = False) -> None:
    """Shard one ``GatedDeltaNet`` over ``group`` in place. ``column`` / ``row`` build the
    (LoRA-aware) parallel linears, ``shard(param, dim, rows=None)`` a parameter's shard and
    ``mark_partial(module)`` marks replicated weights with partial gradients (the tensor-parallel
    module's own helpers, so one set of rules makes every split)."""
    size, rank = group.size, group.rank
    validate_gated_delta_net_tp(mixer.config, size)
    mixer.in_proj_qkvz = column(mixer.in_proj_qkvz, group, sequence_parallel=sequence_parallel)
    mixer.in_proj_ba = column(mixer.in_proj_ba, group, sequence_parallel=sequence_parallel)
    conv = mixer.conv1d
    conv.weight = shard(conv.weight, 0, rows=part_rows(conv_parts(mixer), rank, size))
    mixer.A_log = shard(mixer.A_log, 0)
    mixer.dt_bias = shard(mixer.dt_bias, 0)
    mark_partial(mixer.norm)
    mixer.out_proj = row(mixer.out_proj, group, sequence_parallel=sequence_parallel)
