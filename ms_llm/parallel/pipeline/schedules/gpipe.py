"""GPipe (``parallel.schedules_method gpipe``, the name ``torch.distributed.pipelining`` uses):
all forwards, then all backwards, last micro-batch first.

Its bubble equals 1F1B's ((p-1)/(m+p-1)); it holds every micro-batch's activations (1F1B:
``pp - rank``), and its backwards run last-in first-out, the only order MindSpore 2.10 can run
pending backward closures in (``actions.kept_backwards``): no forward is re-run for a backward.
"""
from __future__ import annotations

from .actions import Action
from .one_f_one_b import one_f_one_b_note
from .spec import ScheduleSpec


def gpipe(pp: int, rank: int, num_microbatches: int) -> list[Action]:
    """GPipe for ``rank``: every forward, then every backward in reverse micro-batch order."""
    return [Action("F", mb) for mb in range(num_microbatches)] + \
        [Action("B", mb) for mb in reversed(range(num_microbatches))]


SCHEDULE = ScheduleSpec(
    name="gpipe", label="GPipe", method="gpipe",
    rank_actions=lambda pp, rank, m, vpp: gpipe(pp, rank, m),
    bubble_note=one_f_one_b_note, chunks_rule="runs one model chunk per rank")
