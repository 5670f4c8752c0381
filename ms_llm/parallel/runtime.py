"""Process-level distributed setup for jobs launched by ``msrun`` (or run as a single process)."""
from __future__ import annotations

import atexit
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    launched_by_msrun: bool = False


def launched_by_msrun() -> bool:
    return "MS_ROLE" in os.environ


def init_distributed() -> DistInfo:
    """Join the msrun cluster when launched by msrun; otherwise a single process, no init.

    msrun also runs the training script in its scheduler process (``MS_ROLE=MS_SCHED``); there
    ``init()`` serves the cluster and the process must exit afterwards without training.
    """
    if not launched_by_msrun():
        if int(os.environ.get("RANK_SIZE", "1")) > 1:
            raise RuntimeError("RANK_SIZE > 1 but not launched by msrun: start multi-process "
                               "jobs with scripts/pretrain.sh (NPROC=N) or msrun")
        return DistInfo()
    from mindspore.communication import get_group_size, get_rank, init

    init()
    if os.environ.get("MS_ROLE") == "MS_SCHED":
        raise SystemExit(0)
    from .comm import mark_initialized
    from .comm.teardown import release
    info = DistInfo(rank=get_rank(), world_size=get_group_size(), launched_by_msrun=True)
    mark_initialized(info.rank, info.world_size)
    atexit.register(release)     # our threads and shared memory end before MindSpore's exit
    return info
