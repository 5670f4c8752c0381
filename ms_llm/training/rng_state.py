"""Random state that an exact resume restores: NumPy's global generator, MindSpore's default
generator (``mindspore.get_rng_state``: the ``mint`` random ops, Ascend's dropout) and the
per-kernel seed counters of MindSpore's legacy random ops (``ops.dropout``, the CPU dropout).

The checkpoint carries rank 0's state (rank 0 writes the metadata) and every rank restores it:
exact wherever the ranks draw the same random numbers, which holds when every rank runs the same
layers (data, tensor, expert, FSDP parallel: the counters advance alike); pipeline stages other
than rank 0's get rank 0's counters (their dropout masks then differ from an uninterrupted run).
"""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Tensor

from ms_llm.compat import private_api


def capture() -> dict:
    rng = np.random.get_state()
    return {"numpy": [rng[0], rng[1].tolist(), rng[2], rng[3], rng[4]],
            "mindspore": ms.get_rng_state().asnumpy().tolist(),
            "mindspore_kernel_seeds": private_api.legacy_kernel_seeds()}


def restore(state: dict) -> None:
    """Restore ``capture()``'s dict (older checkpoints carry the NumPy state only)."""
    np.random.set_state(tuple(state["numpy"]))
    if "mindspore" in state:
        ms.set_rng_state(Tensor(np.asarray(state["mindspore"], np.uint8)))
    if "mindspore_kernel_seeds" in state:
        private_api.set_legacy_kernel_seeds(state["mindspore_kernel_seeds"])
