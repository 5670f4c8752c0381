"""One record per parameter saying how it is split over the device mesh.

DTensor describes a tensor by a placement per mesh dimension; Megatron's distributed checkpoint
describes each piece by its global shape and offset. ``Placement`` is that idea once, for every
parameter: which mesh dimensions shard which tensor dimension (outermost first), how a shard maps
onto global rows (the layout), over which mesh dimensions the local gradient is only a partial
sum, and where the tensor sits in the full model (global indices). Everything that depends on the
split is derived from it and nowhere stored twice:

* ``checkpoint_regions``: the region of the global tensor a rank writes and reads;
* ``writes_checkpoint``: whether this rank is the replica that writes it;
* ``grad_replica_dim``: the mesh dimension a gradient is summed over (data parallel, expert-data
  parallel, or none when FSDP's reduce-scatter already did it);
* ``norm_dims``: the mesh dimensions a gradient's squares are summed over for the global norm.

Sharding steps compose: tensor parallel shards the full parameter evenly, expert parallel keeps a
block of experts, FSDP then splits the rank's (tp/ep-local) dim 0 with the ``torch.chunk`` rule.
Every step uses the chunk rule (``RowShard``), which is the even split when sizes divide.

Layouts:

* ``plain``: each shard is a contiguous range of its tensor dimension.
* ``glu_halves``: a fused ``[gate; up]`` weight (dim 0). Tensor parallel splits each half, so a
  rank holds ``[gate_r; up_r]``; FSDP then cuts that concatenation. Checkpoints store the halves
  as ``<name>:gate`` and ``<name>:up``, each one rectangle whatever the layout.
* ``row_parts``: like ``glu_halves`` with named parts of any sizes along dim 0 (Gated DeltaNet's
  conv1d channels ``[q; k; v]``): ``row_parts`` names them with their global row counts, tensor
  parallel splits each part, checkpoints store ``<name>:<part>``.
* ``row_blocks``: the tensor is stored as rows of ``row_width`` (grouped experts' ``weight1``
  ``[H, E*2F]`` viewed ``[E*H, 2F]``); an expert-parallel shard is a block of memory, i.e. a
  block of those rows, and FSDP's dim-0 rows map to whole rows of the view.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

# The chunk rule every sharding step uses (``torch.chunk``; HyperParallel's non-uniform FSDP):
# with dim length D0 over W ranks, C = ceil(D0 / W) rows per rank for communication; rank r holds
# the real rows [r*C, min((r+1)*C, D0)), which may be empty (2 rows on 4 ranks: 1,1,0,0).
# All-gathers use a padded buffer of C rows per rank and then narrow to D0; reduce-scatters pad
# the gradient with a zero tail to C*W rows.
@dataclass(frozen=True)
class RowShard:
    rows: int          # D0
    world: int
    rank: int

    @property
    def chunk(self) -> int:
        return -(-self.rows // self.world)

    @property
    def start(self) -> int:
        return min(self.rank * self.chunk, self.rows)

    @property
    def length(self) -> int:
        return max(0, min(self.start + self.chunk, self.rows) - self.start)

    @property
    def padded_rows(self) -> int:
        return self.chunk * self.world

    @property
    def even(self) -> bool:
        return self.rows % self.world == 0


LAYOUTS = ("plain", "glu_halves", "row_parts", "row_blocks")
# emb: the first and last pipeline stage of one (tp, cp, dp) coordinate, which both hold the
# tied embedding weight (a singleton group on the other stages); dp_cp / edp_cp: data parallel
# (expert-data parallel) together with context parallel, Megatron's dp-cp group, over which FSDP
# and the distributed optimizer cut when cp > 1 (a cp rank holds the same weights for other
# tokens, so it is one more data-parallel replica to shard over)
MESH_DIMS = ("tp", "cp", "dp", "ep", "edp", "pp", "emb", "dp_cp", "edp_cp")
# The data-parallel cuts (FSDP's shard, the distributed optimizer's): one per tensor, dim 0.
DP_CUTS = ("dp", "edp", "dp_cp", "edp_cp")


@dataclass(frozen=True)
class Placement:
    # (mesh dim, tensor dim), outermost first; tensor dim None: the mesh dim selects whole
    # tensors (one expert of many), ``global_index`` says which
    shards: Tuple[Tuple[str, Optional[int]], ...] = ()
    layout: str = "plain"
    row_width: Optional[int] = None                # row_blocks: width of the stored rows
    row_parts: Tuple[Tuple[str, int], ...] = ()    # row_parts: (name, global rows), in order
    partial: Tuple[str, ...] = ()                  # mesh dims the local gradient is partial over
    global_index: Tuple[Tuple[str, int, int], ...] = ()   # (name component, local, global)
    global_shape: Optional[Tuple[int, ...]] = None  # shape before any shard (None: unsharded)

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"Placement: unknown layout {self.layout!r} (one of {LAYOUTS})")
        for mesh_dim, _ in self.shards:
            if mesh_dim not in MESH_DIMS:
                raise ValueError(f"Placement: unknown mesh dim {mesh_dim!r} (one of {MESH_DIMS})")
        for mesh_dim in self.partial:
            if mesh_dim not in MESH_DIMS:
                raise ValueError(f"Placement: unknown mesh dim {mesh_dim!r} (one of {MESH_DIMS})")
        if self.layout == "row_blocks" and not self.row_width:
            raise ValueError("Placement: layout row_blocks needs row_width")
        if self.layout == "row_parts" and not self.row_parts:
            raise ValueError("Placement: layout row_parts needs row_parts")

    @property
    def mesh_dims(self) -> Tuple[str, ...]:
        return tuple(d for d, _ in self.shards)

    def sharded_over(self, mesh_dim: str) -> bool:
        return mesh_dim in self.mesh_dims

    @property
    def dp_cut(self) -> Optional[str]:
        """The data-parallel mesh dim (one of ``DP_CUTS``) this tensor is cut over, if any."""
        return next((d for d in self.mesh_dims if d in DP_CUTS), None)

    def covers(self, mesh_dim: str) -> bool:
        """Sharded over ``mesh_dim``, alone or as part of a combined dim (``dp_cp`` covers dp
        and cp)."""
        return any(d == mesh_dim or (d.endswith("_cp") and mesh_dim in ("cp", d[:-3]))
                   for d in self.mesh_dims)


_ATTR = "placement"


def placement_of(param) -> Placement:
    """The parameter's record; an unmarked parameter is replicated everywhere."""
    return getattr(param, _ATTR, None) or Placement()


def set_placement(param, placement: Placement) -> None:
    setattr(param, _ATTR, placement)


def update_placement(param, **changes) -> Placement:
    """Set fields of the parameter's record (a new frozen record replaces the old)."""
    pl = replace(placement_of(param), **changes)
    set_placement(param, pl)
    return pl


def add_shard(param, full_shape: Sequence[int], mesh_dim: str,
              tensor_dim: Optional[int]) -> Placement:
    """Record one more sharding step applied to a tensor whose shape was ``full_shape``."""
    pl = placement_of(param)
    gshape = pl.global_shape if pl.global_shape is not None else tuple(full_shape)
    return replace(pl, shards=pl.shards + ((mesh_dim, tensor_dim),), global_shape=gshape)


def add_partial(param, mesh_dim: str) -> None:
    pl = placement_of(param)
    if mesh_dim not in pl.partial:
        set_placement(param, replace(pl, partial=pl.partial + (mesh_dim,)))


# --------------------------------------------------------------------------- derived facts
class Mesh(NamedTuple):
    """This rank's coordinate and the size of every mesh dimension."""
    rank: Dict[str, int]
    size: Dict[str, int]

    @classmethod
    def of(cls, pstate) -> "Mesh":
        s = pstate.sizes
        last = pstate.pp_rank == s.pp - 1 and s.pp > 1
        ranks = {"tp": pstate.tp_rank, "cp": pstate.cp_rank, "dp": pstate.dp_rank,
                 "pp": pstate.pp_rank, "ep": pstate.ep_rank, "edp": pstate.dp_rank // s.ep,
                 "emb": int(last)}
        sizes = {"tp": s.tp, "cp": s.cp, "dp": s.dp, "pp": s.pp, "ep": s.ep, "edp": s.dp // s.ep,
                 "emb": 2 if s.pp > 1 and pstate.pp_rank in (0, s.pp - 1) else 1}
        for d in ("dp", "edp"):   # index in the (e)dp x cp group: cp fastest (ranks tp-cp-dp)
            ranks[d + "_cp"] = ranks["cp"] + s.cp * ranks[d]
            sizes[d + "_cp"] = s.cp * sizes[d]
        return cls(ranks, sizes)


def grad_replica_dim(pl: Placement) -> Optional[str]:
    """Mesh dim whose ranks hold replicas of this parameter, over which its gradient must be
    summed; ``None`` when the parameter is sharded over it (FSDP reduce-scatters in backward)."""
    dim = "edp" if pl.sharded_over("ep") else "dp"
    return None if pl.dp_cut is not None else dim


def grad_replica_dims(pl: Placement) -> Tuple[str, ...]:
    """Every mesh dim this parameter's gradient is summed over: ``grad_replica_dim`` and
    context parallel, whose ranks hold the same weights for other tokens (Megatron's
    data-parallel-with-context-parallel group). FSDP's reduce-scatter already summed it over
    its cut: nothing left after a ``dp_cp`` cut, cp after a ``dp`` cut (cp = 1 then)."""
    dim = grad_replica_dim(pl)
    if dim is None:
        return () if pl.covers("cp") else ("cp",)
    return (dim, "cp")


def norm_dims(pl: Placement) -> Tuple[str, ...]:
    """Mesh dims over which the gradient's squares are summed: its distinct shard dims (a
    ``dp_cp`` cut as dp then cp: summing over both groups in turn sums over the dp x cp
    group, so the global norm needs no group of its own)."""
    dims = []
    for d in pl.mesh_dims:
        dims += [d[:-3], "cp"] if d in ("dp_cp", "edp_cp") else [d]
    return tuple(dict.fromkeys(dims))


def counted_in_norm(pl: Placement, mesh: Mesh) -> bool:
    """A tensor held whole on two pipeline stages (the tied embedding, partial over ``emb``)
    counts once in a norm summed over the pipeline: on the first stage."""
    return not ("emb" in pl.partial and mesh.rank["emb"] != 0)


def writes_checkpoint(pl: Placement, mesh: Mesh) -> bool:
    """The first replica writes: rank 0 along every dim the tensor is replicated over (incl.
    the dims its gradient is partial over, whose ranks hold copies)."""
    replicas = ["tp", "cp", "edp" if pl.sharded_over("ep") else "dp"] + list(pl.partial)
    return all(mesh.rank[d] == 0 for d in replicas if not pl.covers(d)
               and not (d == "edp" and pl.covers("dp")))


def checkpoint_name(name: str, pl: Placement) -> str:
    """A tensor's checkpoint name: its global indices, whatever this rank calls it (an expert
    kept under expert parallel is stored as ``local_experts.{global}``)."""
    for component, local, glob in pl.global_index:
        key = f"{component}.{local}."
        if key not in name:
            raise ValueError(f"checkpoint: parameter {name} has no '{key}' component")
        name = name.replace(key, f"{component}.{glob}.", 1)
    return name


class Region(NamedTuple):
    """One rectangle of a global tensor held by this rank: checkpoint name, global shape,
    offsets, sizes, and the dim-0 range ``[lstart, lstart + length)`` of the local tensor (in
    the stored view) that holds it."""
    name: str
    gshape: Tuple[int, ...]
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    lstart: int
    length: int


def _apply(dims: List[int], shards, mesh: Mesh) -> Tuple[List[int], List[int]]:
    """Walk the shards outermost first: per tensor dim, the local offset and size."""
    off = [0] * len(dims)
    size = list(dims)
    for mesh_dim, tdim in shards:
        if tdim is None:
            continue
        rs = RowShard(size[tdim], mesh.size[mesh_dim], mesh.rank[mesh_dim])
        off[tdim] += rs.start
        size[tdim] = rs.length
    return off, size


def checkpoint_regions(name: str, shape: Sequence[int], pl: Placement, mesh: Mesh,
                       split_glu: bool = True) -> List[Region]:
    """The regions of the global tensor this rank's local tensor (``shape``) holds."""
    name = checkpoint_name(name, pl)
    gshape = list(pl.global_shape if pl.global_shape is not None else shape)
    if not gshape:
        return [Region(name, (), (), (), 0, 0)]
    if pl.layout == "row_blocks":
        return [_row_block_region(name, gshape, shape, pl, mesh)]
    if pl.layout == "glu_halves" and split_glu:
        return _part_regions(name, gshape, pl, mesh, glu_parts(gshape[0]))
    if pl.layout == "row_parts" and split_glu:
        return _part_regions(name, gshape, pl, mesh, pl.row_parts)
    off, size = _apply(gshape, pl.shards, mesh)
    return [Region(name, tuple(gshape), tuple(off), tuple(size), 0, size[0])]


def _row_block_region(name, gshape, shape, pl: Placement, mesh: Mesh) -> Region:
    """Grouped expert weights stored as rows of ``row_width``: the expert-parallel shard is a
    block of memory (a block of stored rows); FSDP's rows of dim 0 are whole stored rows."""
    w = pl.row_width
    total_rows = int(np.prod(gshape)) // w
    start, rows = 0, total_rows
    local_dims = list(gshape)
    for mesh_dim, tdim in pl.shards:
        if tdim is None:                          # whole tensor (a pipeline stage's layer)
            continue
        if mesh_dim in ("dp", "dp_cp"):           # FSDP: dim 0 of the ep-local tensor
            per_row = int(np.prod(local_dims[1:])) // w
            rs = RowShard(local_dims[0], mesh.size[mesh_dim], mesh.rank[mesh_dim])
            start += rs.start * per_row
            rows = rs.length * per_row
            local_dims[0] = rs.length
        else:                                     # a block of memory: rows of the view
            rs = RowShard(rows, mesh.size[mesh_dim], mesh.rank[mesh_dim])
            start += rs.start
            rows = rs.length
            local_dims[tdim] = RowShard(local_dims[tdim], mesh.size[mesh_dim],
                                        mesh.rank[mesh_dim]).length
    return Region(name, (total_rows, w), (start, 0), (rows, w), 0, rows)


def glu_parts(rows: int) -> Tuple[Tuple[str, int], ...]:
    """A fused ``[gate; up]`` weight's two named parts."""
    return (("gate", rows // 2), ("up", rows // 2))


def _part_regions(name, gshape, pl: Placement, mesh: Mesh, parts) -> List[Region]:
    """Named dim-0 parts (``[gate; up]``, ``[q; k; v]``): shards before the data-parallel cut
    split each part, so a rank holds ``[part0_r; part1_r; ...]``; FSDP (or the distributed
    optimizer) then cuts that local concatenation."""
    rest = list(gshape[1:])
    if sum(rows for _, rows in parts) != gshape[0]:
        raise ValueError(f"checkpoint: {name}: parts {parts} do not add up to {gshape[0]} rows")
    # the data-parallel cut (FSDP's, or the distributed optimizer's: DP_CUTS) is the last
    outer = [s for s in pl.shards if s[0] not in DP_CUTS]
    fsdp = [s for s in pl.shards if s[0] in DP_CUTS]
    if any(tdim != 0 for _, tdim in fsdp) or len(fsdp) > 1:
        raise ValueError(f"checkpoint: {name}: a weight of named parts is cut once along dim 0 "
                         f"over dp")
    local = []
    for _, rows in parts:
        off, size = _apply([rows] + rest, outer, mesh)
        local.append((off, size))
    total = sum(size[0] for _, size in local)
    start, length = 0, total
    if fsdp:
        dim = fsdp[0][0]
        rs = RowShard(total, mesh.size[dim], mesh.rank[dim])
        start, length = rs.start, rs.length
    out, base = [], 0
    for (part, rows), (off, size) in zip(parts, local):
        lo, hi = max(start, base), min(start + length, base + size[0])
        n = max(0, hi - lo)
        first = (off[0] + lo - base) if n else 0
        out.append(Region(f"{name}:{part}", (rows,) + tuple(rest),
                          (first,) + tuple(off[1:]), (n,) + tuple(size[1:]),
                          lo - start if n else 0, n))
        base += size[0]
    return out


def stored_view(data: np.ndarray, pl: Placement) -> np.ndarray:
    """The local array in the checkpoint's row view (``row_blocks`` layout), else as is."""
    return data.reshape(-1, pl.row_width) if pl.layout == "row_blocks" else data
