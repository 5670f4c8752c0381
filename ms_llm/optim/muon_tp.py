"""Muon under tensor parallel (``training.muon_tp_mode``), Megatron-Core's three modes
(``TensorParallelMuon`` / emerging_optimizers' ``newton_schulz_tp``, read, not imported):

* ``blockwise``: each rank orthogonalises its own shard alone (no collective; a different
  update from one process: each shard is made orthogonal, not the matrix);
* ``duplicated``: the shards are all-gathered along the split dimension, every rank of the
  tp group orthogonalises the whole matrix and keeps its slice (equal to one process);
* ``distributed``: Newton-Schulz runs on the shards, the squared norm and each step's Gram
  matrix all-reduced over tp (the Gram is taken over the *unsplit* dimension, so a
  column-parallel ``[out/tp, in]`` shard iterates transposed, as the reference forces); equal
  to one process up to summation order, with ``tp`` times less GEMM work per rank but one
  all-reduce of an ``in x in`` (or ``out x out``) matrix per step.

The update's scale (``muon_scale_mode``) uses the global shape in every mode but blockwise,
as Megatron's ``scaled_orthogonalize_fn`` does.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

from mindspore import Parameter, Tensor, mint

from ms_llm.parallel import comm
from ms_llm.parallel.placement import placement_of
from .newton_schulz import Coeffs, newton_schulz

TP_MODES = ("blockwise", "duplicated", "distributed")


def partition_dim(param: Parameter) -> Optional[int]:
    """The tensor dimension tensor parallel splits ``param`` along (None: not split)."""
    return next((d for m, d in placement_of(param).shards if m == "tp"), None)


class TensorParallelNS:
    """Newton-Schulz of a (possibly tp-split) matrix in ``mode`` over ``group`` (None or a
    group of one: plain Newton-Schulz everywhere)."""

    def __init__(self, mode: str = "duplicated", group=None, precision: str = "highest"):
        if mode not in TP_MODES:
            raise ValueError(f"training.muon_tp_mode: {mode!r} is not one of "
                             f"{', '.join(TP_MODES)}")
        self.mode, self.precision = mode, precision
        self.group = group if group is not None and group.size > 1 else None
        if self.group is not None and mode == "distributed" and precision != "highest":
            raise ValueError(f"training.muon_fp32_matmul_prec {precision} with muon_tp_mode "
                             f"distributed: not built (the sharded Newton-Schulz runs in fp32)")

    def split_dim(self, dim: Optional[int]) -> Optional[int]:
        """The split this mode acts on: None when blockwise or without a tp group."""
        return None if self.group is None or self.mode == "blockwise" else dim

    def global_shape(self, shape: Sequence[int], dim: Optional[int]) -> Tuple[int, int]:
        """``[out, in]`` of the whole matrix (for the scale) from a shard's ``shape``."""
        out, inp = int(shape[-2]), int(shape[-1])
        dim = self.split_dim(dim)
        if dim == 0:
            out *= self.group.size
        elif dim == 1:
            inp *= self.group.size
        return out, inp

    def __call__(self, x: Tensor, dim: Optional[int], schedule: Sequence[Coeffs]) -> Tensor:
        """This rank's part of the orthogonalised matrix whose shard along ``dim`` is ``x``."""
        dim = self.split_dim(dim)
        if dim is None:
            return newton_schulz(x, schedule, precision=self.precision)
        g = self.group
        if self.mode == "duplicated":
            parts = [mint.zeros(x.shape, dtype=x.dtype) for _ in range(g.size)]
            comm.all_gather(parts, x.contiguous(), group=g)
            whole = newton_schulz(mint.cat(parts, dim=dim), schedule, precision=self.precision)
            return mint.narrow(whole, dim, g.rank * x.shape[dim], x.shape[dim])

        def all_reduce(t: Tensor) -> Tensor:
            comm.all_reduce(t, group=g)
            return t
        return newton_schulz(x, schedule, transpose=dim == 0, reduce=all_reduce)
