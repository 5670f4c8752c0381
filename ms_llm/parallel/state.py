"""The device mesh: data, tensor, context, pipeline and expert parallel groups.

Ranks are laid out as Megatron-Core does, tensor parallel fastest:
``rank = tp + TP * (cp + CP * (dp + DP * pp))``. Expert parallel subdivides the data-parallel
dimension (``ep`` consecutive dp ranks form an expert group; ``expert_data`` groups hold the same
experts), as in Megatron's default ``tp-cp-ep-dp-pp`` order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

from . import comm

_DIMS = ("tp", "cp", "dp", "pp")


@dataclass(frozen=True)
class ParallelSizes:
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    world: int = 1

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.cp * self.pp)

    def validate(self) -> None:
        for name in ("tp", "cp", "pp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel: {name} size must be >= 1")
        inner = self.tp * self.cp * self.pp
        if self.world % inner:
            raise ValueError(f"parallel: world size {self.world} is not divisible by tensor x "
                             f"context x pipeline = {self.tp} x {self.cp} x {self.pp}")
        if self.dp % self.ep:
            raise ValueError(f"parallel: expert_model_parallel_size {self.ep} must divide the "
                             f"data-parallel size {self.dp}")


class ParallelState:
    """This process's coordinates and groups in the mesh."""

    def __init__(self, sizes: ParallelSizes, rank: Optional[int] = None):
        sizes.validate()
        self.sizes = sizes
        self.rank = comm.get_rank() if rank is None else rank
        r = self.rank
        self.tp_rank = r % sizes.tp
        self.cp_rank = (r // sizes.tp) % sizes.cp
        self.dp_rank = (r // (sizes.tp * sizes.cp)) % sizes.dp
        self.pp_rank = r // (sizes.tp * sizes.cp * sizes.dp)
        self.ep_rank = self.dp_rank % sizes.ep
        self.groups: Dict[str, comm.ProcessGroup] = {}

    def ranks_along(self, dim: str) -> list:
        """Global ranks that differ from this one only along ``dim`` (tp, cp, dp, pp, ep, edp,
        emb; dp_cp / edp_cp: along dp or edp and cp together, where gradients of parameters
        replicated over context parallel are summed)."""
        s = self.sizes
        coords = {"tp": self.tp_rank, "cp": self.cp_rank, "dp": self.dp_rank, "pp": self.pp_rank}
        size = {"tp": s.tp, "cp": s.cp, "dp": s.dp, "pp": s.pp}

        def rank_of(c):
            return c["tp"] + s.tp * (c["cp"] + s.cp * (c["dp"] + s.dp * c["pp"]))
        if dim in _DIMS:
            return [rank_of({**coords, dim: i}) for i in range(size[dim])]
        if dim == "emb":     # first and last pipeline stage (tied embedding); else alone
            if s.pp > 1 and self.pp_rank in (0, s.pp - 1):
                return [rank_of({**coords, "pp": 0}), rank_of({**coords, "pp": s.pp - 1})]
            return [self.rank]
        base = self.dp_rank - self.ep_rank
        if dim == "ep":
            return [rank_of({**coords, "dp": base + i}) for i in range(s.ep)]
        if dim == "edp":
            return [rank_of({**coords, "dp": self.ep_rank + s.ep * i}) for i in range(s.dp // s.ep)]
        if dim in ("dp_cp", "edp_cp"):   # data parallel with context parallel (Megatron's)
            return sorted(rank_of({**coords, "dp": d, "cp": c}) for c in range(s.cp)
                          for d in (range(s.dp) if dim == "dp_cp"
                                    else range(self.ep_rank, s.dp, s.ep)))
        raise ValueError(f"unknown parallel dimension {dim!r}")

    # Every group a rank holds, in creation order; dp_cp / edp_cp are the groups replicated
    # gradients are summed over (without context parallel they equal dp / edp).
    GROUP_DIMS = ("tp", "cp", "dp", "pp", "ep", "edp", "emb", "dp_cp", "edp_cp")

    def build_groups(self) -> "ParallelState":
        # Every rank creates its own groups in the same dimension order, so the members of each
        # group reach its creation together (MindSpore's creation is collective among members).
        for dim in self.GROUP_DIMS:
            self.groups[dim] = comm.new_group(self.ranks_along(dim))
        return self

    def group(self, dim: str) -> comm.ProcessGroup:
        return self.groups[dim]


_CURRENT: Dict[str, ParallelState] = {}


def initialize_model_parallel(tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1
                              ) -> ParallelState:
    """Megatron's ``initialize_model_parallel``: build and remember the mesh for this process."""
    state = ParallelState(ParallelSizes(tp=tp, cp=cp, pp=pp, ep=ep,
                                        world=comm.get_world_size())).build_groups()
    _CURRENT["state"] = state
    return state


def get_parallel_state() -> ParallelState:
    if "state" not in _CURRENT:
        return initialize_model_parallel()
    return _CURRENT["state"]
