"""MoE layers under tensor parallel, as Megatron-Core runs them.

The attention and the dense layers are split by ``tensor_parallel``; a MoE layer is split here:

* the routed path runs on this rank's piece of the sequence: with sequence parallel the layer's
  input already is that piece; without it every tensor rank holds the whole sequence and the
  layer keeps its piece on the way in and all-gathers the pieces on the way out
  (``SequenceShard``). So each token is routed once in the tensor-parallel group and the
  dispatcher (``expert_parallel``) moves the rows over the tp x ep group;
* the router is replicated: its gradient on each rank covers that rank's tokens only (partial
  over ``tp``, summed like the norm weights under sequence parallel), and the load-balancing
  losses pool their routed counts over the tensor-parallel group (``TPTokens``, and then over
  context parallel's group);
* shared experts are a dense MLP split column/row like the layer's other MLPs (sequence
  parallel exchanges included); split, their ``[gate; up]`` weight is stored as its halves
  (``glu_halves``) like a dense MLP's, whole otherwise (a resume reads either form,
  ``training/checkpointing.py``). The optional shared-expert gate is replicated; under
  sequence parallel it sees this rank's tokens (partial over ``tp``).
"""
from __future__ import annotations

from mindspore import Tensor

from ms_llm.compat import F
from ms_llm.models.moe import moe_layers
from . import autograd as pa
from . import comm
from .placement import add_partial, update_placement
from .tensor_parallel import TensorParallelContext, glu_rows


class TPTokens:
    """``TopKRouter.token_partition`` under tensor parallel: each sequence is cut over the tensor
    ranks. Counts are summed over them; each rank reports the whole loss (every tensor rank
    logs the same language-model loss) with the gradient of its own share."""

    def __init__(self, group, inner=None):
        self.group, self.inner = group, inner    # inner: context parallel's partition
        self.pieces = group.size * getattr(inner, "pieces", 1)

    def sum_counts(self, counts: Tensor) -> Tensor:
        out = F.clone(counts)
        comm.all_reduce(out, group=self.group)
        return out if self.inner is None else self.inner.sum_counts(out)

    def whole_loss(self, share: Tensor) -> Tensor:
        total = F.clone(F.stop_gradient(share))
        comm.all_reduce(total, group=self.group)
        return share + F.stop_gradient(total - share)


class SequenceShard:
    """``MoELayer.sequence_shard`` under tensor parallel without sequence parallel: this rank's
    contiguous piece of the sequence (dim 1) on the way in (backward: all-gather), the pieces
    all-gathered on the way out (backward: this rank's piece), Megatron's scatter/gather pair."""

    def __init__(self, group):
        self.group = group

    def enter(self, hidden_states: Tensor) -> Tensor:
        if hidden_states.ndim != 3 or hidden_states.shape[1] % self.group.size:
            raise ValueError(f"MoE under tensor parallel: the sequence ({hidden_states.shape}) "
                             f"must split evenly over parallel.tensor_model_parallel_size "
                             f"({self.group.size})")
        return pa.scatter_to_group(hidden_states, self.group, 1)

    def leave(self, y: Tensor) -> Tensor:
        return pa.gather_from_group(y, self.group, 1)


def apply_moe_tensor_parallel(model, group, sequence_parallel: bool = False,
                              comm_overlap: bool = False) -> int:
    """Split every MoE layer of ``model`` over the tensor-parallel ``group`` (see the module
    docstring); returns how many layers. The experts themselves are split by
    ``expert_parallel.apply_expert_parallel`` (expert tensor parallel)."""
    if group.size == 1:
        return 0
    ctx = TensorParallelContext(group, sequence_parallel, comm_overlap)
    layers = moe_layers(model)
    for layer in layers:
        add_partial(layer.router.weight, "tp")
        # under context parallel too: pieces of pieces (its partition runs first)
        layer.router.token_partition = TPTokens(group, layer.router.token_partition)
        if not sequence_parallel:
            layer.sequence_shard = SequenceShard(group)
        shared = layer.shared_experts
        if shared is None:
            continue
        fc1, rows = shared.linear_fc1, None
        if layer.config.gated_linear_unit:
            for p in (fc1.weight, fc1.bias):
                if p is not None:
                    update_placement(p, layout="glu_halves")
            rows = glu_rows(fc1.out_features, group.rank, group.size)
        shared.linear_fc1 = ctx.column(fc1, rows=rows, overlap=True)
        shared.linear_fc2 = ctx.row(shared.linear_fc2, overlap=True)
        if shared.gate_weight is not None and sequence_parallel:
            add_partial(shared.gate_weight, "tp")
    return len(layers)
