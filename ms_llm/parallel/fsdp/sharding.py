"""Non-uniform dim-0 sharding (the ``torch.chunk`` rule, as HyperParallel specifies it).

With dim-0 length D0 over W ranks: C = ceil(D0 / W) rows per rank for communication; rank r
holds the real rows [r*C, min((r+1)*C, D0)), which may be empty (2 rows on 4 ranks: 1,1,0,0).
All-gathers use a padded buffer of C rows per rank and then narrow to D0; reduce-scatters pad
the gradient with a zero tail to C*W rows. When D0 % W == 0 nothing is padded or copied.
"""
from __future__ import annotations

from dataclasses import dataclass


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
