"""Expert parallelism, applied from outside the model (torchtitan's discipline).

``apply_expert_parallel`` keeps this rank's ``E / ep`` experts of every MoE layer and gives the
layer an all-to-all token dispatcher (Megatron's ``MoEAlltoAllTokenDispatcher``):

1. permute the local tokens by global expert (``ms_llm.ops.moe``), count rows per expert;
2. exchange the per-expert counts over the ep group (one ``all_gather`` of E integers), which
   gives every rank the full split matrix of both all-to-alls;
3. all-to-all the rows to the ranks owning their experts (uneven splits, zero allowed);
4. regroup the received rows from (source rank, local expert) to (local expert, source rank)
   order, so each local expert's rows are one block for the grouped matmul;
5. after the experts, the reverse: un-regroup, all-to-all back, unpermute + weighted combine.

Gradients flow through both all-to-alls (``parallel.autograd.all_to_all``) and the row gathers.
Expert parameters are marked ``expert_parallel`` (their gradients are reduced over the
expert-data-parallel group, and the norm sums them over the ep group) and carry where they sit in
the global tensor, so distributed checkpoints are layout independent.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
from mindspore import Parameter, Tensor

from ms_llm.compat import F, nn
from ms_llm.models.moe import MoELayer, MoELocalTokenDispatcher, moe_layers
from . import autograd as pa
from . import comm

DISPATCHERS = ("alltoall", "megamoe")


def regroup_index(blocks: np.ndarray) -> np.ndarray:
    """Row order that turns received rows laid out (source rank, local expert) into (local
    expert, source rank). ``blocks[i, l]`` = rows from rank i for local expert l."""
    w, n_local = blocks.shape
    offsets = np.concatenate([[0], np.cumsum(blocks.reshape(-1))])[:-1].reshape(w, n_local)
    pieces = [np.arange(offsets[i, l], offsets[i, l] + blocks[i, l])
              for l in range(n_local) for i in range(w)]
    return np.concatenate(pieces).astype(np.int32) if pieces else np.zeros(0, np.int32)


def gather_rows(x: Tensor, index: Optional[np.ndarray]) -> Tensor:
    """``x[index]`` (differentiable); ``None`` = identity."""
    return x if index is None else F.embedding(Tensor(index), x)


def regroup_indices(blocks: np.ndarray) -> Tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """``(index, inverse)`` row gathers for ``regroup_index(blocks)`` and back; ``None`` where
    the order is already expert-major (one source rank or one local expert)."""
    index = regroup_index(blocks)
    if np.array_equal(index, np.arange(index.size)):
        return None, None
    return index, np.argsort(index).astype(np.int32)


class MoEAlltoAllTokenDispatcher(MoELocalTokenDispatcher):
    """Dispatch to the experts of ``group`` (the expert-parallel group) and combine back."""

    def __init__(self, num_experts: int, topk: int, group: comm.ProcessGroup):
        super().__init__(num_experts, topk)
        if num_experts % group.size:
            raise ValueError(f"num_moe_experts ({num_experts}) is not divisible by "
                             f"parallel.expert_model_parallel_size ({group.size})")
        self.group = group
        self.num_local_experts = num_experts // group.size
        self._state = None

    def exchange_counts(self, tokens_per_expert: Sequence[int]) -> np.ndarray:
        """``[W, E]``: rows every ep rank routes to every global expert."""
        return comm.exchange_split_sizes([int(c) for c in tokens_per_expert], self.group)

    def token_permutation(self, hidden_states: Tensor, probs: Tensor,
                          top_indices: Tensor) -> Tuple[Tensor, List[int]]:
        permuted, tokens_per_expert = super().token_permutation(hidden_states, probs,
                                                                top_indices)
        w, r, n_local = self.group.size, self.group.rank, self.num_local_experts
        counts = self.exchange_counts(tokens_per_expert)                   # [W, E]
        matrix = counts.reshape(w, w, n_local).sum(-1)                     # [src, dst]
        blocks = counts[:, r * n_local:(r + 1) * n_local]                  # [src, local e]
        recv = pa.all_to_all(permuted, self.group, matrix[:, r], matrix[r], split_matrix=matrix)
        index, inverse = regroup_indices(blocks)
        self._state = (matrix, inverse)
        return gather_rows(recv, index), [int(v) for v in blocks.sum(0)]

    def token_unpermutation(self, expert_output: Tensor) -> Tensor:
        if self._state is None:
            raise RuntimeError("token_unpermutation called without token_permutation")
        matrix, inverse = self._state
        self._state = None
        r = self.group.rank
        back = pa.all_to_all(gather_rows(expert_output, inverse), self.group, matrix[r],
                             matrix[:, r], split_matrix=matrix.T)
        return super().token_unpermutation(back)


def _shard_experts(layer: MoELayer, rank: int, size: int) -> List[Parameter]:
    """Keep experts ``[rank*L, (rank+1)*L)``; mark the kept parameters."""
    experts, n = layer.experts, layer.config.num_moe_experts
    n_local = n // size
    first = rank * n_local
    if hasattr(experts, "weight1"):       # GroupedMLP or its MXFP8 replacement
        # weight1 [H, E*2F] and weight2 [E*F, H] are *viewed* [E, H, 2F] / [E, F, H]: expert e
        # is the e-th contiguous block of memory (for weight1 not a column slice).
        kept = []
        for attr in ("weight1", "weight2"):
            old = getattr(experts, attr)
            flat = old.asnumpy().reshape(n, -1)[first:first + n_local]
            local_shape = (old.shape[0], old.shape[1] // size) if attr == "weight1" else \
                (old.shape[0] // size, old.shape[1])
            p = Parameter(Tensor(np.ascontiguousarray(flat).reshape(local_shape)).astype(
                old.dtype), name=old.name, requires_grad=old.requires_grad)
            if hasattr(old, "dcp_row_width"):
                p.dcp_row_width = old.dcp_row_width
            p.expert_shard = (rank, size)       # memory block ``rank`` of ``size``
            setattr(experts, attr, p)
            kept.append(p)
        experts.num_local_experts = n_local
    else:
        local = list(experts.local_experts)[first:first + n_local]
        experts.local_experts = nn.ModuleList(local)
        experts.num_local_experts = n_local
        kept = []
        for j, expert in enumerate(local):
            for _, p in expert.parameters_and_names():
                p.expert_index = (j, first + j)     # (local, global): checkpoint names
                kept.append(p)
    for p in kept:
        p.expert_parallel = True
    return kept


def apply_expert_parallel(model, group: comm.ProcessGroup, *, dispatcher: str = "alltoall",
                          expert_groups: int = 2, token_chunks: int = 1,
                          timeline=None) -> List[Parameter]:
    """Shard every MoE layer's experts over ``group`` and install the token dispatcher.
    Returns the expert parameters this rank keeps (empty when ``group`` has one rank)."""
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"moe.dispatcher must be one of {DISPATCHERS}, got {dispatcher!r}")
    kept: List[Parameter] = []
    for layer in moe_layers(model):
        c = layer.config
        if c.num_moe_experts % group.size:
            raise ValueError(f"model.num_moe_experts ({c.num_moe_experts}) is not divisible by "
                             f"parallel.expert_model_parallel_size ({group.size})")
        if group.size > 1:
            kept += _shard_experts(layer, group.rank, group.size)
        if dispatcher == "megamoe":
            from .megamoe import MegaMoEDispatcher
            if not getattr(layer.experts, "plain_linears", lambda: True)():
                raise ValueError("moe.dispatcher megamoe runs the expert GEMMs itself and does "
                                 "not support quantized (MXFP8) experts; use moe.dispatcher "
                                 "alltoall or add '*.experts.*' to quant.ignored_modules")
            layer.token_dispatcher = MegaMoEDispatcher(c.num_moe_experts, c.moe_router_topk,
                                                       group, expert_groups, token_chunks,
                                                       timeline=timeline)
        elif group.size > 1:
            layer.token_dispatcher = MoEAlltoAllTokenDispatcher(c.num_moe_experts,
                                                                c.moe_router_topk, group)
    return kept
