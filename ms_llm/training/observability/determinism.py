"""``training.deterministic`` (MindSpeed's ``--use-deter-comp``): a rerun of the same config
gives bit-identical losses and gradient norms.

What it switches on, once per process and before the model is built:

* MindSpore's deterministic computation (``mindspore.set_deterministic(True)``), which on
  Ascend also sets ``HCCL_DETERMINISTIC=true`` (HCCL's fixed reduction order) and
  ``TE_PARALLEL_COMPILER=1``; the variable is also set here before ``communication.init`` so the
  world group is created deterministic (MindSpore's advice);
* a fixed reduction order in the CPU collectives (``ms_llm.parallel.comm.set_deterministic``):
  ``all_reduce`` sum/avg becomes a list ``all_gather`` plus a sum in rank order, identical on
  every rank, instead of whatever order mccl's algorithm takes. ``reduce_scatter_tensor``
  already combines the scattered slices in rank order, and the expert-parallel ``all_to_all``
  assembles received rows in source-rank order;
* expert token gathering is in a fixed order already: ``ms_llm.ops.moe.sort_by_expert`` sorts
  on unique (expert, slot) keys, so equal expert ids never tie.
"""
from __future__ import annotations

import os

_APPLIED = [False]


def apply_deterministic(enabled: bool) -> bool:
    """Switch deterministic mode on (idempotent; ``enabled=False`` changes nothing, since
    MindSpore's setting can be made only once per process). True when it is on."""
    if not enabled:
        return _APPLIED[0]
    if _APPLIED[0]:
        return True
    import mindspore as ms
    from ms_llm.parallel import comm
    os.environ.setdefault("HCCL_DETERMINISTIC", "true")
    try:
        ms.set_deterministic(True)
    except RuntimeError as e:   # already configured by the caller: keep theirs if it is on
        if "repeatedly" not in str(e):
            raise
    comm.set_deterministic(True)
    _APPLIED[0] = True
    return True
