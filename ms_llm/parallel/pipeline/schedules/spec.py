"""The schedule registry: one ``ScheduleSpec`` record per pipeline schedule, one file each.

A schedule file in this package defines ``SCHEDULE = ScheduleSpec(...)``; ``all_schedules``
finds every such file, so adding a schedule is that file (and its test). Generic code (the
config rules, the executor, the model split, the memory plan, ``ms-llm schedule``, the MindSpeed
flag mapping) asks the record chosen by ``parallel.schedules_method`` and
``parallel.virtual_pipeline_model_parallel_size`` (``schedule_of``) and never tests a schedule's
name.
"""
from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable, Optional

from .actions import Action, check_sizes
from .placement import ROUND_ROBIN, StagePlacement

# (pp, rank, num_microbatches, vpp) -> that rank's actions
RankActions = Callable[[int, int, int, int], "list[Action]"]
# (rounds, pp, num_microbatches) -> the line ``ms-llm schedule`` prints about the bubble
BubbleNote = Callable[[list, int, int], str]


@dataclass(frozen=True)
class ScheduleSpec:
    """Everything generic code may ask about one pipeline schedule.

    ``method`` is the ``parallel.schedules_method`` value that selects it (None: Megatron's
    default, 1F1B or interleaved 1F1B by the chunk count). ``min_chunks``/``max_chunks`` is the
    virtual-stage rule: the ``parallel.virtual_pipeline_model_parallel_size`` values it runs
    (1..1 forbids virtual stages, 2..None requires them, 2..2 sets them: MindSpeed's flag then
    sets the key itself); ``chunks_rule`` says it in the refusal. ``microbatches_per_rank``: the
    schedule needs at least that many x pp micro-batches (0: any count)."""
    name: str
    label: str                          # how ``ms-llm schedule`` titles it
    method: Optional[str]
    rank_actions: RankActions
    bubble_note: BubbleNote
    chunks_rule: str                    # e.g. "runs one model chunk per rank"
    min_chunks: int = 1
    max_chunks: Optional[int] = 1       # None: no upper bound
    placement: StagePlacement = ROUND_ROBIN
    splits_backward: bool = False       # B gives the input gradient only, a later W the weights'
    microbatches_per_rank: int = 0
    mindspeed: bool = False             # a value of MindSpeed's --schedules-method

    @property
    def config_name(self) -> str:
        """How messages name the schedule: by the config value that selects it."""
        if self.method is None:
            return f"the {self.label} schedule"
        return f"parallel.schedules_method {self.method}"

    def runs_chunks(self, vpp: int) -> bool:
        """Whether the schedule runs ``vpp`` model chunks per rank."""
        return self.min_chunks <= vpp and (self.max_chunks is None or vpp <= self.max_chunks)

    def chunks_refusal(self, vpp: int) -> str:
        """One line: the virtual pipeline size this schedule needs instead of ``vpp``."""
        want = self.min_chunks if self.min_chunks == self.max_chunks else \
            f"to at least {self.min_chunks}"
        return (f"{self.config_name} {self.chunks_rule}: set "
                f"parallel.virtual_pipeline_model_parallel_size {want} (got {vpp})")

    def build(self, pp: int, num_microbatches: int, vpp: int) -> list[list[Action]]:
        """Every rank's action list, after the schedule's own rules (chunks, micro-batches)."""
        if not self.runs_chunks(vpp):
            raise ValueError(self.chunks_refusal(vpp))
        check_sizes(pp, num_microbatches, vpp)
        least = self.microbatches_per_rank * pp
        if num_microbatches < least:
            times = "" if self.microbatches_per_rank == 1 else f"{self.microbatches_per_rank} x "
            raise ValueError(
                f"{self.config_name} needs at least {times}parallel.pipeline_model_parallel_size "
                f"({least}) micro-batches, got {num_microbatches} (training.global_batch_size / "
                f"(training.micro_batch_size x data-parallel size))")
        return [self.rank_actions(pp, r, num_microbatches, vpp) for r in range(pp)]


@functools.lru_cache(maxsize=None)
def all_schedules() -> tuple[ScheduleSpec, ...]:
    """Every registered schedule (the ``SCHEDULE`` of each module of this package), by name."""
    package = importlib.import_module(__name__.rpartition(".")[0])
    found = []
    for info in pkgutil.iter_modules(package.__path__):
        spec = getattr(importlib.import_module(f"{package.__name__}.{info.name}"), "SCHEDULE",
                       None)
        if spec is not None:
            found.append(spec)
    names = [s.name for s in found]
    if len(set(names)) != len(names):
        raise RuntimeError(f"pipeline schedules registered twice: {sorted(names)}")
    return tuple(sorted(found, key=lambda s: s.name))


def _methods() -> list[Optional[str]]:
    """The ``parallel.schedules_method`` values, Megatron's default (None) first."""
    return sorted({s.method for s in all_schedules()}, key=lambda m: (m is not None, m or ""))


def get_schedule(method: Optional[str] = None, vpp: int = 1) -> ScheduleSpec:
    """The schedule ``parallel.schedules_method`` selects for ``vpp`` chunks per rank; raises
    ValueError (one line) for an unknown method or a chunk count it cannot run."""
    specs = [s for s in all_schedules() if s.method == method]
    if not specs:
        raise ValueError(f"parallel.schedules_method {method!r} is unknown; choose one of "
                         f"{', '.join(str(m) for m in _methods())}")
    for spec in specs:
        if spec.runs_chunks(vpp):
            return spec
    raise ValueError(specs[0].chunks_refusal(vpp))


def schedule_of(parallel) -> ScheduleSpec:
    """The schedule of a config's ``parallel`` section (only meaningful with pp > 1)."""
    return get_schedule(parallel.schedules_method, parallel.virtual_pipeline_model_parallel_size)
