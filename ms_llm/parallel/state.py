"""The device mesh: data, tensor, context, pipeline and expert parallel groups.

Ranks are laid out as Megatron-Core does, tensor parallel fastest:
``rank = tp + TP * (cp + CP * (dp + DP * pp))``.

Experts have their own grid over the same ranks (Megatron-Core's ``expert_decoder`` rank
generator, order ``tp-ep-dp-pp``): within a pipeline stage the ``tp x cp x dp`` ranks are folded
as ``etp x ep x edp`` (expert tensor parallel fastest, then expert parallel, then expert data
parallel). With the expert-tensor-parallel size equal to the tensor-parallel size (Megatron's
default) this is the familiar layout where expert parallel subdivides the data-parallel
dimension (``ep`` consecutive dp ranks form an expert group, cp kept apart); with another size
(``parallel.expert_tensor_parallel_size``, or MindSpeed's ``moe_tp_extend_ep``: etp 1 and
ep x tp expert ranks) the expert groups cut across the tensor-parallel ranks ("folded"), which
needs context parallel 1 here. ``tp_ep`` is the group the token dispatcher exchanges over
(Megatron's ``tp_ep_group``: the etp x ep ranks of one expert-data-parallel replica).
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
    etp: Optional[int] = None     # expert tensor parallel; None: the tensor-parallel size

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.cp * self.pp)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def folded(self) -> bool:
        """The expert grid cuts across the tensor-parallel ranks (etp != tp)."""
        return self.expert_tp != self.tp

    @property
    def edp(self) -> int:
        if self.folded:
            return (self.tp * self.cp * self.dp) // (self.expert_tp * self.ep)
        return self.dp // self.ep

    def validate(self) -> None:
        for name in ("tp", "cp", "pp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel: {name} size must be >= 1")
        inner = self.tp * self.cp * self.pp
        if self.world % inner:
            raise ValueError(f"parallel: world size {self.world} is not divisible by tensor x "
                             f"context x pipeline = {self.tp} x {self.cp} x {self.pp}")
        if self.expert_tp < 1:
            raise ValueError("parallel: expert_tensor_parallel_size must be >= 1")
        if not self.folded:
            if self.dp % self.ep:
                raise ValueError(f"parallel: expert_model_parallel_size {self.ep} must divide "
                                 f"the data-parallel size {self.dp} (tensor_model_parallel_size "
                                 f"x expert_model_parallel_size = {self.tp} x {self.ep} "
                                 f"expert-group ranks on {self.world} workers)")
            return
        stage = self.tp * self.cp * self.dp
        if stage % (self.expert_tp * self.ep):
            raise ValueError(f"parallel: expert_tensor_parallel_size x expert_model_parallel_size"
                             f" = {self.expert_tp} x {self.ep} must divide the {stage} ranks of "
                             f"a pipeline stage (tensor x context x data parallel)")
        if self.cp > 1:
            raise ValueError(f"parallel: expert_tensor_parallel_size {self.expert_tp} differs "
                             f"from tensor_model_parallel_size {self.tp} with "
                             f"context_parallel_size {self.cp}: not built (context parallel 1)")


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
        if sizes.folded:
            local = r % (sizes.tp * sizes.cp * sizes.dp)
            self.etp_rank = local % sizes.expert_tp
            self.ep_rank = (local // sizes.expert_tp) % sizes.ep
            self.edp_rank = local // (sizes.expert_tp * sizes.ep)
        else:
            self.etp_rank = self.tp_rank
            self.ep_rank = self.dp_rank % sizes.ep
            self.edp_rank = self.dp_rank // sizes.ep
        self.groups: Dict[str, comm.ProcessGroup] = {}

    def ranks_along(self, dim: str) -> list:
        """Global ranks that differ from this one only along ``dim`` (tp, cp, dp, pp, ep, edp,
        etp, tp_ep, emb; dp_cp / edp_cp: along dp or edp and cp together, where gradients of
        parameters replicated over context parallel are summed)."""
        s = self.sizes
        if s.folded and dim in ("ep", "edp", "etp", "tp_ep", "edp_cp"):
            return self._folded_ranks(dim)
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
        if dim == "etp":
            return self.ranks_along("tp")
        if dim == "tp_ep":   # etp fastest, then ep (the sorted order of these global ranks)
            return sorted(rank_of({**coords, "tp": t, "dp": base + i})
                          for i in range(s.ep) for t in range(s.tp))
        if dim == "ep":
            return [rank_of({**coords, "dp": base + i}) for i in range(s.ep)]
        if dim == "edp":
            return [rank_of({**coords, "dp": self.ep_rank + s.ep * i}) for i in range(s.dp // s.ep)]
        if dim in ("dp_cp", "edp_cp"):   # data parallel with context parallel (Megatron's)
            return sorted(rank_of({**coords, "dp": d, "cp": c}) for c in range(s.cp)
                          for d in (range(s.dp) if dim == "dp_cp"
                                    else range(self.ep_rank, s.dp, s.ep)))
        raise ValueError(f"unknown parallel dimension {dim!r}")

    def _folded_ranks(self, dim: str) -> list:
        """The expert grid folded over a pipeline stage: local = etp + ETP * (ep + EP * edp)."""
        s = self.sizes
        stage = s.tp * s.cp * s.dp
        base = self.pp_rank * stage
        etp, ep = s.expert_tp, s.ep
        coords = {"etp": self.etp_rank, "ep": self.ep_rank, "edp": self.edp_rank}

        def rank_of(c):
            return base + c["etp"] + etp * (c["ep"] + ep * c["edp"])
        if dim == "tp_ep":
            return [rank_of({**coords, "etp": t, "ep": e}) for e in range(ep) for t in range(etp)]
        dim = "edp" if dim == "edp_cp" else dim     # cp is 1 in the folded layout
        size = {"etp": etp, "ep": ep, "edp": s.edp}[dim]
        return [rank_of({**coords, dim: i}) for i in range(size)]

    # Every group a rank holds, in creation order; dp_cp / edp_cp are the groups replicated
    # gradients are summed over (without context parallel they equal dp / edp).
    GROUP_DIMS = ("tp", "cp", "dp", "pp", "ep", "edp", "emb", "dp_cp", "edp_cp", "etp", "tp_ep")

    def build_groups(self) -> "ParallelState":
        # Every rank creates its own groups in the same dimension order, so the members of each
        # group reach its creation together (MindSpore's creation is collective among members).
        for dim in self.GROUP_DIMS:
            self.groups[dim] = comm.new_group(self.ranks_along(dim))
        return self

    def group(self, dim: str) -> comm.ProcessGroup:
        return self.groups[dim]


_CURRENT: Dict[str, ParallelState] = {}


def expert_sizes(p) -> tuple:
    """``(ep, etp)`` of a ``ParallelConfig``: Megatron's expert-tensor-parallel size defaults to
    the tensor-parallel size; MindSpeed's ``moe_tp_extend_ep`` makes the tensor ranks extra
    expert ranks (ep x tp expert ranks, experts not tensor-sliced)."""
    ep, tp = p.expert_model_parallel_size, p.tensor_model_parallel_size
    if getattr(p, "moe_tp_extend_ep", False):
        return ep * tp, 1
    etp = getattr(p, "expert_tensor_parallel_size", None)
    return ep, (tp if etp is None else etp)


def sizes_of(p, world: int) -> ParallelSizes:
    """The mesh sizes a ``ParallelConfig`` asks for on ``world`` ranks."""
    ep, etp = expert_sizes(p)
    return ParallelSizes(tp=p.tensor_model_parallel_size, cp=p.context_parallel_size,
                         pp=p.pipeline_model_parallel_size, ep=ep, world=world, etp=etp)


def initialize_model_parallel(tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1,
                              etp: Optional[int] = None) -> ParallelState:
    """Megatron's ``initialize_model_parallel``: build and remember the mesh for this process."""
    state = ParallelState(ParallelSizes(tp=tp, cp=cp, pp=pp, ep=ep, etp=etp,
                                        world=comm.get_world_size())).build_groups()
    _CURRENT["state"] = state
    return state


def get_parallel_state() -> ParallelState:
    if "state" not in _CURRENT:
        return initialize_model_parallel()
    return _CURRENT["state"]
