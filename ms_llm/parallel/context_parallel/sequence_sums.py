"""Sums over the ranks that hold pieces of the same sequences (the context-parallel group).

Per-token work needs nothing from the other pieces, but some terms pool whole sequences:

* the MoE load-balancing losses pool routed counts per micro-batch or per sequence:
  ``CPTokens`` is installed on every router (``TopKRouter.token_partition``) and sums the counts
  over the cp group (no gradient: counts are not differentiable), so each rank's loss is its
  share of the whole sequences' loss (``ms_llm.models.moe.TopKRouter._record``);
* DPO compares per-sequence log-probability sums: ``sum_over_cp`` adds the pieces' sums with a
  gradient (``ms_llm.parallel.autograd.sum_over_group``).
"""
from __future__ import annotations

from mindspore import Tensor

from ms_llm.compat import F
from ms_llm.models.moe import moe_layers

from .. import comm
from ..autograd import sum_over_group


class CPTokens:
    """``TopKRouter.token_partition`` under context parallel: each sequence is cut over the
    ``cp`` ranks of ``group``."""

    def __init__(self, group):
        self.group = group
        self.pieces = group.size

    def sum_counts(self, counts: Tensor) -> Tensor:
        out = F.clone(counts)
        comm.all_reduce(out, group=self.group)
        return out


def install_router_partition(model, group) -> int:
    """Give every MoE router of ``model`` the cp partition; returns how many."""
    layers = moe_layers(model)
    for layer in layers:
        layer.router.token_partition = CPTokens(group)
    return len(layers)


def sum_over_cp(x: Tensor, group) -> Tensor:
    """Per-sequence partial sums -> whole-sequence sums on every cp rank, differentiable (each
    rank's copy feeds its own share of the loss; see ``sum_over_group``)."""
    return sum_over_group(x, group)


class CPRows:
    """The rows of a DPO micro-batch under context parallel (``ms_llm.training.dpo.WholeRows``'s
    interface): this rank's pieces of every row as model inputs, split exactly as a training
    batch (``ContextParallel.micro_batch``); a row's log-prob sum adds the pieces' sums over the
    cp group with gradient, its token count without. Every cp rank then holds the same pair
    losses, so each weighs them by ``share = 1/cp`` (gradients and logged losses sum over cp)."""

    def __init__(self, cp):
        self.cp, self.group = cp, cp.group
        self.share = 1.0 / cp.cp

    def model_inputs(self, rows: dict) -> dict:
        # positions 0..s-1 of every row (as without cp), cut like the tokens
        return self.cp.micro_batch({k: rows[k] for k in ("tokens", "labels", "loss_mask")},
                                   reset_position_ids=False)

    def sum_logps(self, x: Tensor) -> Tensor:
        return sum_over_cp(x, self.group)

    def sum_counts(self, x: Tensor) -> Tensor:
        out = F.clone(F.stop_gradient(x))
        comm.all_reduce(out, group=self.group)
        return out
