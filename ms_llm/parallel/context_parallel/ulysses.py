"""Ulysses (DeepSpeed; Megatron's ``a2a`` context parallel): before attention an all-to-all turns
sequence-sharded q/k/v (all heads, this rank's tokens) into head-sharded ones (1/u of the heads,
the tokens of all u ranks); after attention the reverse all-to-all restores the sequence shard.

The heads (and KV query groups) must divide by the degree u. With grouped-query attention and
fewer KV heads than u (u a multiple of them), each KV head is replicated u/ng times before the
exchange, as Megatron does, so rank j receives the KV head its query heads read; the gradient of
the replicas sums back through the broadcast.
"""
from __future__ import annotations

from mindspore import Tensor, mint

from ..autograd import all_to_all


def check_heads(num_heads: int, num_groups: int, degree: int, where: str = "") -> None:
    """One-line error unless heads and query groups fit the Ulysses degree."""
    if num_heads % degree:
        raise ValueError(f"{where}Ulysses degree {degree} must divide the attention heads per "
                         f"tensor-parallel rank ({num_heads})")
    if num_groups % degree and degree % num_groups:
        raise ValueError(f"{where}Ulysses degree {degree} and the query groups per tensor-"
                         f"parallel rank ({num_groups}) must divide one another")


def replicate_kv(x: Tensor, degree: int) -> Tensor:
    """[b, ng, s, d] with ng < degree -> [b, degree, s, d]: each head repeated degree/ng times."""
    b, ng, s, d = x.shape
    if ng >= degree:
        return x
    rep = degree // ng
    return mint.broadcast_to(x.unsqueeze(2), (b, ng, rep, s, d)).reshape(b, degree, s, d)


def seq_to_heads(x: Tensor, group) -> Tensor:
    """[b, h, s, d] (this rank's tokens) -> [b, h/u, u*s, d] (the group's tokens in rank order)."""
    u = group.size
    b, h, s, d = x.shape
    rows = x.permute(1, 0, 2, 3).contiguous()                  # [h, b, s, d]: heads as rows
    y = all_to_all(rows, group, [h // u] * u, [h // u] * u)      # block j: rank j's tokens
    y = y.reshape(u, h // u, b, s, d).permute(2, 1, 0, 3, 4)
    return y.reshape(b, h // u, u * s, d)


def heads_to_seq(y: Tensor, group) -> Tensor:
    """Inverse of ``seq_to_heads``: [b, h/u, u*s, d] -> [b, h, s, d]."""
    u = group.size
    b, hu, us, d = y.shape
    s = us // u
    rows = y.reshape(b, hu, u, s, d).permute(2, 1, 0, 3, 4).reshape(u * hu, b, s, d)
    x = all_to_all(rows.contiguous(), group, [hu] * u, [hu] * u)  # block j: rank j's heads
    return x.permute(1, 0, 2, 3)
