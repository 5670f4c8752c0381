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
A kept expert parameter's ``Placement`` gains an ``("ep", dim)`` shard (so its gradient is reduced
over the expert-data-parallel group and the norm sums it over the ep group) and, for per-expert
modules, its global expert index, so distributed checkpoints are layout independent.

Dispatchers are looked up by name in a registry (``register_dispatcher``); the built-in
``megamoe`` entry is named by its import path and imported on first use, so this module does not
import the dispatchers built on top of it.
"""
from __future__ import annotations

import importlib
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
from mindspore import Parameter, Tensor

from ms_llm.compat import F, nn
from ms_llm.models.moe import GroupedMLP, MoELayer, MoELocalTokenDispatcher, moe_layers
from . import autograd as pa
from . import comm
from .placement import add_shard, set_placement, update_placement
from .tensor_parallel import glu_rows


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


def copy_indices(ep_rows: Sequence[int], etp: int) -> Tuple[np.ndarray, List[np.ndarray]]:
    """Under expert tensor parallel every etp rank of an expert's ep rank needs that expert's
    rows (Megatron's all-gather over the etp group, here folded into one all-to-all over the
    tp x ep group, destination ``d = t + etp * e``). ``(send, copies)``: ``send`` picks the
    rows of the permuted buffer (blocks of ep rank ``e``: ``ep_rows[e]`` rows) in destination
    order, each ep block ``etp`` times; ``copies[t][i]`` is where row ``i``'s ``t``-th copy sits
    in that buffer (the partial expert outputs coming back are summed over ``t``)."""
    rows = np.asarray(ep_rows, np.int64)
    offs = np.concatenate([[0], np.cumsum(rows)])
    send, copies = [], [np.zeros(int(offs[-1]), np.int32) for _ in range(etp)]
    pos = 0
    for e, n in enumerate(rows):
        own = np.arange(offs[e], offs[e] + n)
        for t in range(etp):
            send.append(own)
            copies[t][offs[e]:offs[e] + n] = np.arange(pos, pos + n)
            pos += n
    return np.concatenate(send).astype(np.int32), copies


class MoEAlltoAllTokenDispatcher(MoELocalTokenDispatcher):
    """Dispatch to the experts of ``group`` and combine back. ``group`` is the expert-parallel
    group, or under expert tensor parallel (``etp`` > 1) Megatron's tp x ep group (etp fastest):
    the rows of ep rank ``e``'s experts go to all its ``etp`` ranks, each computes a partial
    output (its slice of the expert FFN), and the partials are summed on the way back (the
    all-gather / reduce-scatter over etp of Megatron's ``MoEAlltoAllTokenDispatcher``)."""

    host_counts = True   # the block sizes are exchanged between ranks (host split sizes)

    def __init__(self, num_experts: int, topk: int, group: comm.ProcessGroup, etp: int = 1):
        super().__init__(num_experts, topk)
        if group.size % etp or num_experts % (group.size // etp):
            raise ValueError(f"num_moe_experts ({num_experts}) is not divisible by "
                             f"parallel.expert_model_parallel_size ({group.size // etp})")
        self.group, self.etp = group, etp
        self.ep = group.size // etp
        self.num_local_experts = num_experts // self.ep
        self._state = None

    def exchange_counts(self, tokens_per_expert: Sequence[int]) -> np.ndarray:
        """``[W, E]``: rows every rank of the group routes to every global expert."""
        return comm.exchange_split_sizes([int(c) for c in tokens_per_expert], self.group)

    def token_permutation(self, hidden_states: Tensor, probs: Tensor,
                          top_indices: Tensor) -> Tuple[Tensor, List[int]]:
        permuted, tokens_per_expert = super().token_permutation(hidden_states, probs,
                                                                top_indices)
        w, r, n_local, etp = self.group.size, self.group.rank, self.num_local_experts, self.etp
        counts = self.exchange_counts(tokens_per_expert)                   # [W, E]
        per_ep = counts.reshape(w, self.ep, n_local).sum(-1)               # [src, ep rank]
        matrix = np.repeat(per_ep, etp, axis=1)                            # [src, dst]
        me = r // etp
        blocks = counts[:, me * n_local:(me + 1) * n_local]                # [src, local e]
        send, copies = (None, None) if etp == 1 else copy_indices(per_ep[r], etp)
        recv = pa.all_to_all(gather_rows(permuted, send), self.group, matrix[:, r], matrix[r],
                             split_matrix=matrix)
        index, inverse = regroup_indices(blocks)
        self._state = (matrix, inverse, copies)
        return gather_rows(recv, index), [int(v) for v in blocks.sum(0)]

    def token_unpermutation(self, expert_output: Tensor) -> Tensor:
        if self._state is None:
            raise RuntimeError("token_unpermutation called without token_permutation")
        matrix, inverse, copies = self._state
        self._state = None
        r = self.group.rank
        back = pa.all_to_all(gather_rows(expert_output, inverse), self.group, matrix[r],
                             matrix[:, r], split_matrix=matrix.T)
        if copies is not None:     # the etp ranks' partial outputs of each row, summed
            parts = [gather_rows(back, c) for c in copies]
            back = parts[0]
            for part in parts[1:]:
                back = back + part
        return super().token_unpermutation(back)


def _shard_experts(layer: MoELayer, rank: int, size: int) -> List[Parameter]:
    """Keep experts ``[rank*L, (rank+1)*L)``; record the shard in the kept parameters."""
    experts, n = layer.experts, layer.config.num_moe_experts
    n_local = n // size
    first = rank * n_local
    if hasattr(experts, "weight1"):       # GroupedMLP or its MXFP8 replacement
        # weight1 [H, E*2F] and weight2 [E*F, H] are *viewed* [E, H, 2F] / [E, F, H]: expert e
        # is the e-th contiguous block of memory (for weight1 not a column slice).
        kept = []
        for attr, dim in (("weight1", 1), ("weight2", 0)):
            old = getattr(experts, attr)
            flat = old.asnumpy().reshape(n, -1)[first:first + n_local]
            local_shape = (old.shape[0], old.shape[1] // size) if attr == "weight1" else \
                (old.shape[0] // size, old.shape[1])
            p = Parameter(Tensor(np.ascontiguousarray(flat).reshape(local_shape)).astype(
                old.dtype), name=old.name, requires_grad=old.requires_grad)
            set_placement(p, add_shard(old, old.shape, "ep", dim))
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
                # Whole tensors: the ep shard says which experts this rank holds.
                pl = add_shard(p, p.shape, "ep", None)
                set_placement(p, replace(pl, global_index=pl.global_index
                                         + (("local_experts", j, first + j),)))
                kept.append(p)
    return kept


def _slice(old: Parameter, dim: int, index: Optional[np.ndarray], layout: Optional[str] = None,
           part: Optional[np.ndarray] = None) -> Parameter:
    """This etp rank's ``index`` rows/columns of ``old`` along ``dim`` (or ``part``, already
    cut), recorded as an ``etp`` shard of ``dim``."""
    if layout is not None:
        update_placement(old, layout=layout)
    if part is None:
        part = np.take(old.asnumpy(), index, axis=dim)
    p = Parameter(Tensor(np.ascontiguousarray(part)).astype(old.dtype), name=old.name,
                  requires_grad=old.requires_grad)
    set_placement(p, add_shard(old, old.shape, "etp", dim))
    return p


def _shard_expert_tensor(layer: MoELayer, rank: int, size: int) -> None:
    """Expert tensor parallel: each expert's FFN split like a dense MLP's (``linear_fc1``'s
    ``[gate_r; up_r]`` rows, ``linear_fc2``'s columns); the partial outputs are summed by the
    dispatcher's combine."""
    experts, f = layer.experts, layer.config.moe_ffn_hidden_size
    if f % size:
        raise ValueError(f"model.moe_ffn_hidden_size ({f}) is not divisible by "
                         f"parallel.expert_tensor_parallel_size ({size})")
    rows = glu_rows(2 * f, rank, size)
    cols = np.arange(rank * (f // size), (rank + 1) * (f // size))
    if type(experts) is GroupedMLP:
        # weight1 [H, E*2F] is viewed [E, H, 2F], weight2 [E*F, H] viewed [E, F, H]: each
        # expert's [gate_r; up_r] columns and its F rows, kept in the same views
        e, h = experts.num_local_experts, layer.config.hidden_size
        w1, w2 = experts.weight1, experts.weight2
        experts.weight1 = _slice(w1, 1, None, part=w1.asnumpy().reshape(e, h, 2 * f)[:, :, rows]
                                 .reshape(h, -1))
        experts.weight2 = _slice(w2, 0, None, part=w2.asnumpy().reshape(e, f, h)[:, cols, :]
                                 .reshape(-1, h))
        return
    if not hasattr(experts, "local_experts") or not experts.plain_linears():
        raise ValueError("parallel.expert_tensor_parallel_size > 1 is built for plain expert "
                         "linears (not MXFP8 experts); set parallel.expert_tensor_parallel_size "
                         "1 or moe_tp_extend_ep")
    for expert in experts.local_experts:
        fc1, fc2 = expert.linear_fc1, expert.linear_fc2
        fc1.weight = _slice(fc1.weight, 0, rows, layout="glu_halves")
        fc1.out_features = fc1.weight.shape[0]
        fc2.weight = _slice(fc2.weight, 1, cols)
        fc2.in_features = fc2.weight.shape[1]


DispatcherFactory = Callable[..., Optional[MoELocalTokenDispatcher]]
_DISPATCHERS: Dict[str, Union[str, DispatcherFactory]] = {
    "alltoall": lambda layer, group, etp=1, **_: (MoEAlltoAllTokenDispatcher(
        layer.config.num_moe_experts, layer.config.moe_router_topk, group, etp)
        if group.size > 1 else None),
    "megamoe": "ms_llm.parallel.megamoe:make_dispatcher",
}


def register_dispatcher(name: str, factory: DispatcherFactory) -> None:
    """``factory(layer, group, **options)`` returns the layer's dispatcher, or None to keep the
    layer's local one."""
    _DISPATCHERS[name] = factory


def dispatcher_factory(name: str) -> DispatcherFactory:
    if name not in _DISPATCHERS:
        raise ValueError(f"moe.dispatcher must be one of {sorted(_DISPATCHERS)}, got {name!r}")
    entry = _DISPATCHERS[name]
    if isinstance(entry, str):
        module, attr = entry.split(":")
        entry = _DISPATCHERS[name] = getattr(importlib.import_module(module), attr)
    return entry


def apply_expert_parallel(model, group: comm.ProcessGroup, *, dispatcher: str = "alltoall",
                          tensor_group: Optional[comm.ProcessGroup] = None,
                          dispatch_group: Optional[comm.ProcessGroup] = None,
                          mark: bool = False, **options) -> List[Parameter]:
    """Shard every MoE layer's experts over ``group`` (expert parallel) and ``tensor_group``
    (expert tensor parallel) and install the token dispatcher over ``dispatch_group`` (the
    tp x ep group; ``group`` without expert tensor parallel). ``options`` go to the dispatcher's
    factory (e.g. MegaMoE's ``expert_groups``, ``token_chunks``). ``mark``: record the expert
    shard even on one ep rank (under tensor parallel the experts' gradients are summed over the
    expert-data-parallel group, not the data-parallel one). Returns the expert parameters this
    rank keeps (empty when nothing is sharded or marked)."""
    etp = tensor_group.size if tensor_group is not None else 1
    if etp > 1 and dispatcher != "alltoall":
        raise ValueError(f"moe.dispatcher {dispatcher} with parallel.expert_tensor_parallel_size "
                         f"{etp} is not built; use moe.dispatcher alltoall (or "
                         f"parallel.moe_tp_extend_ep)")
    factory = dispatcher_factory(dispatcher)
    if etp > 1:
        options["etp"] = etp
    kept: List[Parameter] = []
    for layer in moe_layers(model):
        c = layer.config
        if c.num_moe_experts % group.size:
            raise ValueError(f"model.num_moe_experts ({c.num_moe_experts}) is not divisible by "
                             f"parallel.expert_model_parallel_size ({group.size})")
        if etp > 1:
            _shard_expert_tensor(layer, tensor_group.rank, etp)
        if group.size > 1 or mark:
            kept += _shard_experts(layer, group.rank, group.size)
        made = factory(layer, dispatch_group or group, **options)
        if made is not None:
            layer.token_dispatcher = made
    return kept
