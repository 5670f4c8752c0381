"""The non-finite guard (``training.nan_policy``): a step whose loss or gradient is NaN/inf never
reaches the optimizer, and a checkpoint never holds a non-finite value.

``stop`` (default) ends the run at that step, naming the first parameter whose gradient is not
finite (and the rank that holds it), before the update and before any save of that state: the
last checkpoint on disk stays the last good one. ``skip`` drops the update (the data and the LR
schedule still advance, as Megatron's skipped iterations do), counts it, and stops once more than
``training.max_skipped_steps`` steps were skipped.

The decision is taken on the global gradient norm (and the loss), which every rank computes
identically after the norm's all-reduces, so all ranks skip or stop together; locating the
parameter costs one host scan plus one tiny all-gather, and only on the failure path.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import numpy as np
from mindspore import Tensor


class NonFiniteError(FloatingPointError):
    """Training met a non-finite loss/gradient (nan_policy stop) or too many skipped steps."""


def first_nonfinite(names: Sequence[str], arrays) -> Optional[int]:
    """Index of the first tensor (Tensor or ndarray) with a NaN or inf, else None."""
    for i, a in enumerate(arrays):
        data = a.asnumpy() if isinstance(a, Tensor) else np.asarray(a)
        if data.dtype.kind == "f" and not np.isfinite(data.astype(np.float32)).all():
            return i
    return None


def locate(names: Sequence[str], grads: Sequence[Tensor], rank: int, world: int) -> str:
    """The first non-finite gradient: its parameter on this rank, else which rank holds one.
    Collective over the world group (every rank calls it)."""
    from mindspore import int32, mint
    from ms_llm.parallel import comm
    i = first_nonfinite(names, grads)
    mine = Tensor(np.array([-1 if i is None else i], np.int32))
    gathered = [mint.zeros((1,), dtype=int32) for _ in range(world)]
    comm.all_gather(gathered, mine, group=comm.world_group())
    if i is not None:
        return f"{names[i]} (rank {rank})"
    holders = [r for r, t in enumerate(gathered) if int(t.asnumpy()[0]) >= 0]
    if holders:
        return f"a parameter on rank {holders[0]} (its log names it)"
    return "none of the gradients (the loss itself)"


class NonFiniteGuard:
    def __init__(self, policy: str, max_skipped: int, rank: int = 0, world: int = 1):
        self.policy, self.max_skipped = policy, max_skipped
        self.rank, self.world = rank, world
        self.skipped = 0

    def check(self, step: int, loss: float, norm: float, names: Sequence[str],
              grads: Sequence[Tensor]) -> bool:
        """True to skip this step's update; raises ``NonFiniteError`` to stop. Collective when
        the step is not finite and there are several workers (all ranks reach it together)."""
        if math.isfinite(loss) and math.isfinite(norm):
            return False
        where = self._locate(names, grads)
        what = f"step {step}: loss {loss}, grad norm {norm}; first non-finite gradient: {where}"
        if self.policy == "stop":
            raise NonFiniteError(f"{what} (training.nan_policy stop: the update and any save of "
                                 f"this state are skipped; the last checkpoint is the last good "
                                 f"one)")
        self.skipped += 1
        if self.skipped > self.max_skipped:
            raise NonFiniteError(f"{what}: {self.skipped} steps skipped, more than "
                                 f"training.max_skipped_steps={self.max_skipped}")
        print(f"ms-llm: skipped the update of {what} (training.nan_policy skip, "
              f"{self.skipped} skipped so far)", flush=True)
        return True

    def _locate(self, names, grads) -> str:
        if self.world > 1:
            return locate(names, grads, self.rank, self.world)
        i = first_nonfinite(names, grads)
        return f"{names[i]}" if i is not None else "none of the gradients (the loss itself)"


def guard_for(cfg, dist) -> NonFiniteGuard:
    """The guard of ``training.nan_policy`` / ``max_skipped_steps`` for this rank."""
    t = cfg.training
    return NonFiniteGuard(t.nan_policy, t.max_skipped_steps, dist.rank, dist.world_size)


def names_of(params: Sequence, named_params: Sequence) -> List[str]:
    """Model names of the optimizer's parameters (its own ``name`` for a shard it made)."""
    by_id = {id(q): n for n, q in named_params}
    return [by_id.get(id(p), getattr(p, "name", f"param{i}")) for i, p in enumerate(params)]
