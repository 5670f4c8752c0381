"""Interleaved 1F1B: Megatron-Core's ``forward_backward_pipelining_with_interleaving`` (virtual
pipeline), the default schedule with ``parallel.virtual_pipeline_model_parallel_size`` > 1.

Each rank holds ``vpp`` model chunks placed round-robin (virtual stage ``chunk * pp + rank``), so
the fill and drain cost ``pp - 1`` chunk slots instead of whole stages: the bubble shrinks to
``(p-1)/(m vpp + p-1)``, for ``vpp`` times the point-to-point messages. It needs at least ``pp``
micro-batches.
"""
from __future__ import annotations

from .actions import Action
from .one_f_one_b import one_f_one_b_note, one_f_one_b_order
from .spec import ScheduleSpec


def _interleaved_table(pp: int, num_microbatches: int, vpp: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) in forward order for ``num_microbatches % pp == 0``: each group of
    ``pp`` microbatches runs through every chunk before the next group starts. ``pp`` is the
    smallest group for which rank 0 never waits: microbatch ``g``'s chunk-``c`` output needs
    ``pp`` steps to come round the ring, exactly the time rank 0 spends on the group's chunk ``c``."""
    table = []
    for start in range(0, num_microbatches, pp):
        table += [(mb, chunk) for chunk in range(vpp) for mb in range(start, start + pp)]
    return table


def _megatron_interleaved(pp: int, rank: int, num_microbatches: int, vpp: int) -> list[Action]:
    """Megatron's order when ``pp`` divides the microbatch count. Warmup is
    ``2 * (pp - rank - 1) + (vpp - 1) * pp`` forwards (all of them when ``m == pp``): enough
    for the last rank to reach chunk ``vpp - 1`` of microbatch 0, so backwards can start.
    Backwards walk the same table with chunks reversed."""
    table = _interleaved_table(pp, num_microbatches, vpp)
    total = len(table)
    if num_microbatches == pp:
        warmup = total
    else:
        warmup = min(2 * (pp - rank - 1) + (vpp - 1) * pp, total)
    fwd = [Action("F", mb, chunk) for mb, chunk in table]
    bwd = [Action("B", mb, vpp - 1 - chunk) for mb, chunk in table]
    return one_f_one_b_order(fwd, bwd, warmup)


def interleaved_1f1b(pp: int, rank: int, num_microbatches: int, vpp: int) -> list[Action]:
    """Megatron's interleaved (virtual pipeline) 1F1B for ``rank`` with ``vpp`` chunks per rank
    (``num_microbatches >= pp``, which ``SCHEDULE.build`` checks).

    When ``pp`` does not divide ``m``, the schedule for the next multiple of ``pp`` is built and
    the phantom microbatches' actions are dropped. Dropping actions only contracts edges of an
    acyclic dependency graph, so the result cannot deadlock; a short last group kept in the
    1F1B order (Megatron's table) can form a cycle, e.g. pp=4, m=5, vpp=3."""
    padded = -(-num_microbatches // pp) * pp
    return [a for a in _megatron_interleaved(pp, rank, padded, vpp)
            if a.microbatch < num_microbatches]


SCHEDULE = ScheduleSpec(
    name="interleaved_1f1b", label="interleaved 1F1B", method=None,
    rank_actions=interleaved_1f1b, bubble_note=one_f_one_b_note,
    chunks_rule="runs several model chunks per rank", min_chunks=2, max_chunks=None,
    microbatches_per_rank=1)
