"""Exchanging small picklable host-side objects between ranks (torch's ``*_object`` collectives).

Its own module because the shared-memory transport (``shm``) agrees on its segment with it
while ``collectives`` routes through ``shm``: both import this, neither imports the other back.
"""
from __future__ import annotations

import pickle
from typing import Optional

import numpy as np
from mindspore import Tensor

from .backend import dist
from .groups import ProcessGroup, member_group


def all_gather_object(object_list: list, obj, group: Optional[ProcessGroup] = None) -> None:
    """torch.distributed.all_gather_object: ``object_list[i]`` = group rank i's picklable
    ``obj``. Built on tensor all_gathers (lengths, then the padded pickles), which every
    backend has; meant for small host-side metadata, e.g. which tensors each rank loads."""
    g = member_group(group)
    if len(object_list) != g.size:
        raise ValueError(f"all_gather_object: object_list has {len(object_list)} entries, the "
                         f"group has {g.size} ranks")
    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    if g.size == 1:
        object_list[0] = pickle.loads(data.tobytes())
        return
    sizes = [Tensor(np.zeros(1, np.int32)) for _ in range(g.size)]
    dist().all_gather(sizes, Tensor(np.array([data.size], np.int32)), group=g.name)
    n = [int(t.asnumpy()[0]) for t in sizes]
    padded = np.zeros(max(n), np.int32)   # int32: mccl's gathers are not checked for uint8
    padded[:data.size] = data
    parts = [Tensor(np.zeros(max(n), np.int32)) for _ in range(g.size)]
    dist().all_gather(parts, Tensor(padded), group=g.name)
    for i, (t, k) in enumerate(zip(parts, n)):
        object_list[i] = pickle.loads(t.asnumpy()[:k].astype(np.uint8).tobytes())
