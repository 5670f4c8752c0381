"""The MoE routers' per-step bookkeeping as a trainer callback: routed-token counts collected
after each training forward, the aux-loss-free expert-bias update after the optimizer step
(counts summed over the data-parallel replicas), and a skipped step's counts dropped."""
from __future__ import annotations

from typing import Callable

import numpy as np

from ms_llm.models.moe import TopKRouter, collect_router_counts, update_expert_bias
from .callbacks import TrainerCallback


def drop_router_counts(model) -> None:
    """Forget the routed-token counts of a skipped step (its expert-bias update is skipped too)."""
    for _, cell in model.cells_and_names():
        if isinstance(cell, TopKRouter):
            cell.collect_counts(keep=False)
            cell.local_tokens_per_expert = np.zeros_like(cell.local_tokens_per_expert)


class ExpertBiasUpdate(TrainerCallback):
    """``collect`` is False under pipeline parallel: the executor collects each chunk's counts
    itself."""

    def __init__(self, model, sum_over_dp: Callable[[np.ndarray], np.ndarray],
                 collect: bool = True):
        self.model, self.sum_over_dp, self.collect = model, sum_over_dp, collect

    def on_micro_batch_end(self, step: int, index: int) -> None:
        if self.collect:
            collect_router_counts(self.model)

    def on_update(self, step: int, skipped: bool) -> None:
        if skipped:     # training.nan_policy skip: no update; the routed counts are dropped too
            drop_router_counts(self.model)
        else:
            update_expert_bias(self.model, self.sum_over_dp)
