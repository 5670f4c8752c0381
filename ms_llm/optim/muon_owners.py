"""Which rank orthogonalises which Muon matrix, and the collectives that bring each matrix to its
owner and the update back (``Muon``'s data-parallel / FSDP / distributed-optimizer layouts).

Matrices are dealt out greedily by size, the same deal on every rank (the work per matrix is
about its elements times its smaller side, which is the same for every hidden matrix of a model
but the K/V ones).

* A replicated matrix (data parallel: ``dp``/``edp``, times ``cp``) is whole on every rank: the
  owner orthogonalises it and one all-gather per group hands every rank all the updates (every
  rank applies every update).
* An FSDP / distributed-optimizer shard (dim 0 cut over its group by the chunk rule, uneven
  included) travels only where it is needed: one all-to-all per group sends each rank's rows of
  every matrix to that matrix's owner, and after Newton-Schulz one all-to-all sends each rank its
  rows of every update. Per rank that is (W-1)/W of its shards out and of its rows in, where
  all-gathers (the earlier form) moved every shard to every rank, W times as much on 2 ranks.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np
from mindspore import Parameter, Tensor, mint

from ms_llm.compat import float32
from ms_llm.parallel import comm
from ms_llm.parallel.distributed_optimizer import shard_rows
from ms_llm.parallel.placement import RowShard, grad_replica_dim, placement_of


class OwnerPlan:
    """The owner of each Muon matrix in its replica group and the exchanges around it."""

    def __init__(self, params: Sequence[Parameter], idx: Sequence[int], names: Sequence[str],
                 pstate=None):
        self.owner: Dict[int, int] = {}
        self.groups: Dict[str, tuple] = {}       # key -> (group, [param indices], fsdp)
        self.full: Dict[int, tuple] = {i: tuple(params[i].shape) for i in idx}
        self.shard: Dict[int, RowShard] = {}
        self._group_of: Dict[int, object] = {}
        if pstate is None:
            return
        by_key: Dict[str, List[int]] = {}
        for i in idx:
            pl = placement_of(params[i])
            key = "fsdp:" + pl.dp_cut if pl.dp_cut is not None else \
                grad_replica_dim(pl) + ("_cp" if pstate.sizes.cp > 1 else "")
            by_key.setdefault(key, []).append(i)
        for key, members in by_key.items():
            fsdp = key.startswith("fsdp:")
            group = pstate.group(key[5:] if fsdp else key)
            if group.size == 1:
                continue
            if fsdp:      # every rank's row count: the full rows and this rank's chunk
                lengths = comm.exchange_split_sizes([params[i].shape[0] for i in members], group)
                for k, i in enumerate(members):
                    rows = int(lengths[:, k].sum())
                    self.shard[i] = RowShard(rows, group.size, group.rank)
                    self.full[i] = (rows,) + tuple(params[i].shape[1:])
            load = [0] * group.size
            for i in sorted(members, key=lambda j: (-int(np.prod(self.full[j])), j)):
                r = load.index(min(load))
                self.owner[i] = r
                load[r] += int(np.prod(self.full[i]))
            self.groups[key] = (group, members, fsdp)
        self._group_of = {i: g for g, m, _ in self.groups.values() for i in m}

    def mine(self, i: int) -> bool:
        """Whether this rank orthogonalises parameter ``i``."""
        return i not in self.owner or self.owner[i] == self._group_of[i].rank

    def _rows(self, i: int, rank: int) -> RowShard:
        """Rank ``rank``'s rows of FSDP matrix ``i``."""
        sh = self.shard[i]
        return RowShard(sh.rows, sh.world, rank)

    def _width(self, i: int) -> int:
        return int(np.prod(self.full[i][1:]))

    def _owned(self, members: Sequence[int], w: int) -> List[List[int]]:
        return [[i for i in members if self.owner[i] == r] for r in range(w)]

    def gather(self, us: Dict[int, Tensor]) -> Dict[int, Tensor]:
        """``us`` with each FSDP shard this rank owns replaced by the whole matrix: one
        all-to-all per group, each rank's rows of a matrix going to its owner only."""
        out = dict(us)
        for group, members, fsdp in self.groups.values():
            if not fsdp:
                continue
            w, me = group.size, group.rank
            owned = self._owned(members, w)
            # [s, r]: elements rank s sends rank r (its rows of the matrices r owns)
            matrix = np.array([[sum(self._rows(i, s).length * self._width(i) for i in owned[r])
                                for r in range(w)] for s in range(w)], np.int64)
            pieces = [us[i].reshape(-1) for r in range(w) for i in owned[r]
                      if self.shard[i].length]
            send = mint.cat(pieces) if pieces else mint.zeros((0,), dtype=float32)
            recv = mint.zeros((int(matrix[:, me].sum()),), dtype=float32)
            comm.all_to_all_v(recv, send, matrix, group=group)
            offset, parts = 0, {i: [] for i in owned[me]}
            for s in range(w):
                for i in owned[me]:
                    n = self._rows(i, s).length * self._width(i)
                    if n:
                        parts[i].append(mint.narrow(recv, 0, offset, n))
                    offset += n
            for i in owned[me]:
                flat = mint.cat(parts[i]) if len(parts[i]) > 1 else parts[i][0]
                out[i] = flat.reshape(self.full[i])
        return out

    def exchange(self, updates: Dict[int, Tensor]) -> None:
        """Fill ``updates`` with every other rank's: replicated groups all-gather every update;
        FSDP groups send each rank its rows of each update (one all-to-all per group)."""
        for group, members, fsdp in self.groups.values():
            if fsdp:
                self._scatter_rows(updates, group, members)
                continue
            per_rank = self._owned(members, group.size)
            sizes = [sum(int(np.prod(self.full[i])) for i in ids) for ids in per_rank]
            width, mine = max(sizes), per_rank[group.rank]
            pieces = [updates[i].reshape(-1) for i in mine]
            if sizes[group.rank] < width:
                pieces.append(mint.zeros((width - sizes[group.rank],), dtype=float32))
            parts = [mint.zeros((width,), dtype=float32) for _ in range(group.size)]
            comm.all_gather(parts, mint.cat(pieces), group=group)
            for r, ids in enumerate(per_rank):
                offset = 0
                for i in ids:
                    n = int(np.prod(self.full[i]))
                    if r != group.rank:
                        updates[i] = mint.narrow(parts[r], 0, offset, n).reshape(self.full[i])
                    offset += n

    def _scatter_rows(self, updates: Dict[int, Tensor], group, members: Sequence[int]) -> None:
        """The owners' whole updates -> every rank's rows of them (``updates`` then holds this
        rank's rows of every matrix of the group)."""
        w, me = group.size, group.rank
        owned = self._owned(members, w)
        # [o, r]: elements owner o sends rank r (r's rows of the matrices o owns)
        matrix = np.array([[sum(self._rows(i, r).length * self._width(i) for i in owned[o])
                            for r in range(w)] for o in range(w)], np.int64)
        pieces = []
        for r in range(w):
            for i in owned[me]:
                rs = self._rows(i, r)
                if rs.length:
                    pieces.append(mint.narrow(updates[i], 0, rs.start, rs.length).reshape(-1))
        send = mint.cat(pieces) if pieces else mint.zeros((0,), dtype=float32)
        recv = mint.zeros((int(matrix[:, me].sum()),), dtype=float32)
        comm.all_to_all_v(recv, send, matrix, group=group)
        offset = 0
        for o in range(w):
            for i in owned[o]:
                shape = (self.shard[i].length,) + tuple(self.full[i][1:])
                n = int(np.prod(shape))
                updates[i] = mint.narrow(recv, 0, offset, n).reshape(shape) if n else \
                    mint.zeros(shape, dtype=float32)
                offset += n


def refuse_empty_shards(named_params: Sequence[tuple], groups, pstate) -> None:
    """Under the distributed optimizer Muon gathers each matrix from every rank of its group,
    so every rank must hold some rows of it (uneven cuts are fine, an empty one is not built).
    The same answer on every rank (it depends on sizes only), so all of them stop together."""
    for n, q in named_params:
        if groups[n].optimizer != "muon":
            continue
        pl = placement_of(q)
        dim = grad_replica_dim(pl)
        if dim is None:        # FSDP-cut: the distributed optimizer refuses it in one line
            continue
        dim += "_cp" if pstate.sizes.cp > 1 else ""
        g = pstate.group(dim)
        rows, _ = shard_rows(tuple(q.shape), pl, dim, g.size, 0)
        if g.size > 1 and RowShard(rows[0], g.size, g.size - 1).length == 0:
            raise ValueError(f"parallel.use_distributed_optimizer with training.optimizer muon: "
                             f"{n}'s {rows[0]} rows cut over {g.size} ranks (chunks of "
                             f"{RowShard(rows[0], g.size, 0).chunk}) leave a rank none (not built)")
