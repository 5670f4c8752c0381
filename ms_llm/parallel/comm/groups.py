"""Process groups: which global ranks take part in a collective, and this process's place in them.

The state lives here (and nowhere else) so that every collective, the watchdog's message and the
point-to-point pairs agree on this process's rank. Before ``mark_initialized`` (a single process,
no msrun) the world is one rank and every group has size 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple

_STATE = {"initialized": False, "rank": 0, "world": 1, "world_group": None, "groups": {}}


@dataclass(frozen=True)
class ProcessGroup:
    """A set of global ranks. ``name`` is MindSpore's group name (None when this process is not a
    member, like torch's ``GroupMember.NON_GROUP_MEMBER``)."""
    ranks: Tuple[int, ...]
    name: Optional[str] = field(default=None, compare=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This process's index in the group (-1 when not a member)."""
        me = _STATE["rank"]
        return self.ranks.index(me) if me in self.ranks else -1

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]


def mark_initialized(rank: int, world_size: int) -> None:
    """Called by ``ms_llm.parallel.runtime.init_distributed`` after ``mindspore...init()``."""
    from mindspore.communication import GlobalComm
    _STATE.update(initialized=True, rank=rank, world=world_size)
    _STATE["world_group"] = ProcessGroup(tuple(range(world_size)), GlobalComm.WORLD_COMM_GROUP)


def get_rank() -> int:
    return _STATE["rank"]


def get_world_size() -> int:
    return _STATE["world"]


def world_group() -> ProcessGroup:
    if _STATE["world_group"] is None:
        _STATE["world_group"] = ProcessGroup((0,), None)
    return _STATE["world_group"]


def new_group(ranks: Sequence[int]) -> ProcessGroup:
    """Create a group. Only member ranks take part (MindSpore's CPU backend errors or hangs when
    non-members call the creation, unlike torch); non-members get a non-member handle."""
    ranks = tuple(sorted(int(r) for r in ranks))
    if len(set(ranks)) != len(ranks) or any(r < 0 or r >= get_world_size() for r in ranks):
        raise ValueError(f"new_group: invalid ranks {list(ranks)} for world size {get_world_size()}")
    if ranks == world_group().ranks:
        return world_group()
    if ranks in _STATE["groups"]:
        return _STATE["groups"][ranks]
    if get_rank() not in ranks:
        return ProcessGroup(ranks, None)
    name = "msllm_" + "_".join(map(str, ranks))
    if len(ranks) > 1:
        from mindspore.communication import create_group
        create_group(name, list(ranks))
    group = ProcessGroup(ranks, name)
    _STATE["groups"][ranks] = group
    return group


def member_group(group: Optional[ProcessGroup]) -> ProcessGroup:
    """``group`` (None: the world), checked to contain this process: a collective on a group
    this rank does not belong to would wait forever for peers that never call it."""
    g = world_group() if group is None else group
    if g.rank < 0:
        raise RuntimeError(f"rank {get_rank()} is not a member of group {list(g.ranks)}")
    return g
