"""Pairwise (DPO) batches and the stage <-> data agreement.

Why: a DPO step runs chosen and rejected answers through the policy in one forward (and through
the reference in one more), so a loader batch of ``B`` pairs becomes ``2B`` rows: the chosen
rows first, then the rejected ones, each masked exactly like an SFT row (loss only on the reply).
Pairwise files used for plain SFT (or SFT files for DPO) would fail deep inside a step, so the
data setup checks the files against ``training.stage`` first and says so in one line."""
from __future__ import annotations

from typing import Dict, Optional

import numpy as np

from .indexed import dataset_exists

SIDES = ("chosen", "rejected")
ROW_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def is_pairwise(prefix: str) -> bool:
    """True when ``prefix`` holds a pairwise handler's output (``*_packed_chosen_input_ids_*``)."""
    return dataset_exists(f"{prefix}_packed_chosen_input_ids_document")


def stage_data_mismatch(prefix: str, stage: Optional[str]) -> Optional[str]:
    """Why ``prefix``'s files cannot train ``stage``, or None."""
    pairwise = is_pairwise(prefix)
    if pairwise and stage != "dpo":
        return (f"{prefix} holds pairwise (chosen/rejected) data, which trains with "
                f"training.stage dpo (set it, or preprocess with an instruction handler for SFT)")
    if stage == "dpo" and not pairwise:
        return (f"training.stage dpo needs pairwise data, but {prefix} has no "
                f"{prefix}_packed_chosen_input_ids_document.bin/.idx (preprocess with "
                f"--handler-name AlpacaStylePairwiseHandler or SharegptStylePairwiseHandler)")
    return None


def pair_rows(batch: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """A loader batch of ``B`` pairs -> ``2B`` rows (chosen rows, then rejected rows)."""
    return {k: np.concatenate([batch[f"{side}_{k}"] for side in SIDES])
            for k in ROW_KEYS if f"chosen_{k}" in batch}
