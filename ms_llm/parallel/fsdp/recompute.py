"""Activation recompute of FSDP units (``training.recompute_*`` with ``parallel.fsdp_size`` > 1).

A recomputed module keeps only its inputs in forward and runs again in backward. Under FSDP the
module reads its weights as the unit's all-gathered full tensors, which exist only while the
unit runs (``FSDPModule.construct`` shadows the shard Parameters with them and removes the shadow
afterwards). MindSpore's ``Cell.recompute`` re-runs the module's own ``construct`` inside its
backward and differentiates it only with respect to its inputs and its registered Parameters, so
under FSDP it would (a) bypass the unit's gather altogether (the recompute wrapper replaces the
call to ``FSDPModule.construct``) and (b) even with the weights in place, send no gradient to the
gathered tensors (they are neither inputs nor Parameters) and so none through the reduce-scatter.

What is built instead: a recomputed FSDP unit passes its gathered full weights to
``mindspore.recompute`` as explicit inputs, in front of the unit's own inputs; the re-run shadows
them over the shard Parameters again. Their gradients then come back as input gradients of the
recompute cell and flow into the unit's gather function, whose backward reduce-scatters them, as
without recompute. With ``reshard_after_forward`` the full tensors' storage is freed after the
forward and refilled by the pre-backward hook on the unit's outputs, which runs before the
recompute's backward (it sits after the unit in forward), so the re-run reads the refilled
weights: nothing is gathered twice, and "keep them gathered for recomputed units" is not needed
(it would hold every recomputed layer's weights from forward to backward, defeating FSDP).

Built: recompute of whole FSDP units (``full`` granularity with the default units
``decoder.layers.*``) and of modules that hold no FSDP-sharded weights (``selective``: the
attention core). Not built (``ValueError`` naming the module): a recomputed module whose weights
belong to an enclosing unit (``recompute_norm``, or layers that are not units), a recomputed unit
containing other units, and a unit holding parameters FSDP does not shard (expert weights under
MoE): each would need those weights as explicit inputs as well.
"""
from __future__ import annotations

from typing import Callable

import mindspore as ms
from mindspore import nn

from ms_llm.compat.nn import shadow_parameter, unshadow_parameter
from .fully_shard import FSDPModule


class _UnitForward(nn.Cell):
    """A unit's own forward (its model class's ``construct``, below ``FSDPModule``) taking the
    gathered full weights in front of its inputs. It registers no Parameters, so
    ``mindspore.recompute`` differentiates the re-run with respect to its inputs only (a shard
    Parameter among its weights would receive a second, zero gradient, added before the
    asynchronous reduce-scatter had filled the first)."""

    def __init__(self, unit):
        super().__init__(auto_prefix=False)
        self._state = unit._fsdp_state                      # plain object: not a sub-cell
        self._forward = super(FSDPModule, unit).construct   # the model class's construct

    def construct(self, *args, **kwargs):
        fparams = self._state.fparams
        n = len(fparams)
        for fp, full in zip(fparams, args[:n]):
            shadow_parameter(fp.owner, fp.attr, full)
        try:
            return self._forward(*args[n:], **kwargs)
        finally:
            for fp in fparams:
                unshadow_parameter(fp.owner, fp.attr)


def run_recomputed(unit, fulls, args, kwargs):
    """Called by ``FSDPModule.construct`` for a unit marked by ``recompute_marker``."""
    return ms.recompute(unit._fsdp_state.rerun, *fulls, *args, **kwargs)


def _describe(cell) -> str:
    return type(cell).__name__.replace("FSDP", "", 1) if isinstance(cell, FSDPModule) \
        else type(cell).__name__


def recompute_marker(roots) -> Callable:
    """The function ``apply_recompute`` calls on each module to recompute, once FSDP has been
    applied to ``roots`` (the model or its pipeline chunks)."""
    units = [c for root in roots for _, c in root.cells_and_names() if isinstance(c, FSDPModule)]
    managed = {id(fp.param) for u in units for fp in u._fsdp_state.fparams}

    def mark(cell) -> None:
        inner = [c for _, c in cell.cells_and_names() if isinstance(c, FSDPModule)
                 and c is not cell]
        if inner:
            raise ValueError(f"training.recompute_* with parallel.fsdp_size > 1: a recomputed "
                             f"{_describe(cell)} containing other FSDP units "
                             f"(parallel.fsdp_modules) is not built yet")
        if isinstance(cell, FSDPModule):
            st = cell._fsdp_state
            own = {id(fp.param) for fp in st.fparams}
            extra = [p.name for p in cell.trainable_params() if id(p) not in own]
            if extra:
                raise ValueError(f"training.recompute_* with parallel.fsdp_size > 1: the FSDP "
                                 f"unit {_describe(cell)} holds parameters FSDP does not shard "
                                 f"({extra[0]}, e.g. MoE experts); recomputing it is not built "
                                 f"yet")
            st.rerun = _UnitForward(cell)
            return
        if any(id(p) in managed for p in cell.get_parameters()):
            raise ValueError(f"training.recompute_* with parallel.fsdp_size > 1: {_describe(cell)}"
                             f" is not an FSDP unit but holds FSDP-sharded weights (e.g. "
                             f"training.recompute_norm, or layers outside parallel.fsdp_modules)"
                             f"; recomputing it is not built yet (only whole units, or modules "
                             f"without weights)")
        cell.recompute()
    return mark
