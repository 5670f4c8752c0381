"""Where a schedule puts its model chunks: the rank and chunk of every virtual stage.

The model's layers are cut into ``pp * vpp`` virtual stages in layer order; a placement says which
(rank, chunk) runs each. Every schedule record names its placement (``ScheduleSpec.placement``),
and the code that cuts the model (``stages.split_model``), moves tensors (``rounds``, the
executor) or plans memory asks it, never the schedule's name.
"""
from __future__ import annotations

from abc import ABC, abstractmethod


class StagePlacement(ABC):
    """The map between virtual stages and (rank, chunk); ``virtual_stage`` and ``stage_of`` are
    inverses."""
    name = ""

    @abstractmethod
    def virtual_stage(self, rank: int, chunk: int, pp: int) -> int:
        """Position of (rank, chunk) in the model's layer order."""

    @abstractmethod
    def stage_of(self, virtual_stage: int, pp: int) -> tuple[int, int]:
        """(rank, chunk) holding ``virtual_stage``."""

    def __repr__(self) -> str:
        return f"<{self.name} placement>"


class RoundRobin(StagePlacement):
    """Megatron's interleaving: virtual stage ``chunk * pp + rank``, so chunk ``c`` of rank ``r``
    feeds chunk ``c`` of rank ``r + 1`` and the last rank's chunk ``c`` feeds rank 0's chunk
    ``c + 1`` (with one chunk per rank: stage ``r`` on rank ``r``)."""
    name = "round-robin"

    def virtual_stage(self, rank: int, chunk: int, pp: int) -> int:
        return chunk * pp + rank

    def stage_of(self, virtual_stage: int, pp: int) -> tuple[int, int]:
        return virtual_stage % pp, virtual_stage // pp


class VShape(StagePlacement):
    """Two chunks per rank in a V: chunk 0 of rank ``r`` is stage ``r`` (down), chunk 1 is stage
    ``2 pp - 1 - r`` (back up). Rank 0 holds the first and the last stage (the embedding and the
    loss), and the last rank hands its chunk-0 output to its own chunk 1."""
    name = "V-shape"

    def virtual_stage(self, rank: int, chunk: int, pp: int) -> int:
        return rank if chunk == 0 else 2 * pp - 1 - rank

    def stage_of(self, virtual_stage: int, pp: int) -> tuple[int, int]:
        if virtual_stage < pp:
            return virtual_stage, 0
        return 2 * pp - 1 - virtual_stage, 1


ROUND_ROBIN = RoundRobin()
V_SHAPE = VShape()
