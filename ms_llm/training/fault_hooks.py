"""Fault tolerance around the step, as trainer callbacks: the test hooks that make failures
happen for real (``faults``: a worker SIGKILLs itself, a gradient turns NaN) and the
restart / watchdog bookkeeping (every rank publishes its status and its current step, so a
collective time-out names the stalled peers)."""
from __future__ import annotations

import os
from typing import List, Sequence

from . import faults
from .callbacks import TrainerCallback


class FaultInjection(TrainerCallback):
    """``MS_LLM_NAN_INJECT`` turns a named gradient NaN before the norm; ``MS_LLM_FAULT_INJECT``
    kills this rank after the gradient all-reduces, before the optimizer update (both on the
    first launch only; ``faults`` documents them)."""

    def __init__(self, names: Sequence[str], rank: int):
        self.names: List[str] = list(names)
        self.rank = rank

    def on_grads(self, step: int, grads: list) -> list:
        return faults.maybe_inject_nan(step, self.names, grads)

    def on_before_update(self, step: int) -> None:
        faults.maybe_kill(step, self.rank)


class RankStatus(TrainerCallback):
    """Every rank's watchdog thread publishes its state in ``<output_dir>/.rank_status`` and
    the step it is in, for the collective time-out report (``parallel.comm.watchdog``)."""

    def __init__(self, output_dir: str):
        from ms_llm.parallel.comm.watchdog import set_status_dir
        set_status_dir(os.path.join(output_dir, ".rank_status"))

    def on_step_begin(self, step: int) -> None:
        from ms_llm.parallel.comm.watchdog import note_step
        note_step(step)


def appends_metrics() -> bool:
    """A relaunch (``ms_llm.training.restart``) appends to the first launch's metrics.jsonl."""
    return faults.restart_attempt() > 0
