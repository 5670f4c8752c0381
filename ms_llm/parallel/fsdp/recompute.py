"""Activation recompute under FSDP (``training.recompute_*`` with ``parallel.fsdp_size`` > 1).

A recomputed module keeps only its inputs in forward and runs again in backward. Under FSDP it
reads its weights as its unit's all-gathered full tensors, which exist only while the unit runs
(``FSDPModule.construct`` shadows the shard Parameters with them and removes the shadow after).
MindSpore's ``Cell.recompute`` re-runs the module's ``construct`` inside its backward and
differentiates the re-run only with respect to the module's inputs and its registered
Parameters. Under FSDP that is wrong twice: the re-run would read the shards (the shadow is
gone), and the gathered tensors, being neither inputs nor Parameters, would get no gradient, so
nothing would reach the unit's reduce-scatter.

So a module recomputed under FSDP passes every weight it reads *at the time of the call* to
``mindspore.recompute`` as an explicit input, in front of its own inputs: the full tensor its
unit gathered (or, for a parameter FSDP does not shard such as an expert weight, the Parameter
itself). The re-run shadows the module's weights with those inputs again, so it computes with
the same values, and their gradients come back as input gradients: into the unit's gather
function (whose backward reduce-scatters them, as without recompute) or into the Parameter.
The recompute cell itself registers no Parameters (a shard among them would receive a second,
zero gradient, added before the asynchronous reduce-scatter had filled the first).

Nothing is gathered twice: with ``reshard_after_forward`` the full tensors' storage is freed
after the unit's forward and refilled by the pre-backward hook on the unit's outputs, which runs
before any recompute inside the unit (it sits after the unit in forward), and the re-run reads
the refilled tensors. Keeping recomputed units gathered from forward to backward instead would
hold every recomputed layer's full weights at once, which is what FSDP exists to avoid.

Applies to whole FSDP units (``full`` with the default units ``decoder.layers.*``), to modules
inside a unit (``recompute_norm``; ``selective``'s attention core has no weights) and to MoE
layers (expert weights are not sharded by FSDP). Not built (``check_recompute_under_fsdp``
raises): a recomputed module that contains an FSDP unit, whose re-run would gather again.
"""
from __future__ import annotations

from typing import Iterable, List, Tuple

import mindspore as ms
from mindspore import Parameter, nn

from ms_llm.compat.nn import shadow_parameter, unshadow_parameter
from .fully_shard import FSDPModule


def _weight_slots(cell) -> List[Tuple[object, str]]:
    """(owning module, attribute) of every trainable parameter in ``cell``'s tree."""
    slots = []
    for _, owner in cell.cells_and_names():
        for attr, p in owner.parameters_and_names(expand=False):
            if p.requires_grad:
                slots.append((owner, attr.rsplit(".", 1)[-1]))
    return slots


class _State:
    """A recomputed module's recompute cell and weight slots, kept outside the Cell tree (as
    Cell attributes they would register the recompute cell, which refers back to the module,
    as a sub-cell)."""

    def __init__(self, cell):
        self.cell = cell
        self.slots: List[Tuple[object, str]] = []
        self.rerun = _Rerun(self)


class _Rerun(nn.Cell):
    """The module's own forward with its weights as leading inputs, shadowed while it runs."""

    def __init__(self, state: _State):
        super().__init__(auto_prefix=False)
        self.state = state

    def construct(self, *args, **kwargs):
        cell, slots = self.state.cell, self.state.slots
        # What each attribute read as before (in forward, a module inside a unit reads the
        # unit's shadows, which the rest of the unit's forward may still need): restored after.
        before = [getattr(owner, attr) for owner, attr in slots]
        for (owner, attr), w in zip(slots, args[:len(slots)]):
            shadow_parameter(owner, attr, w)
        try:
            return super(RecomputedUnderFSDP, cell).construct(*args[len(slots):], **kwargs)
        finally:
            for (owner, attr), b in zip(slots, before):
                if isinstance(b, Parameter):      # the registered Parameter itself
                    unshadow_parameter(owner, attr)
                else:
                    shadow_parameter(owner, attr, b)


class RecomputedUnderFSDP:
    """Mixed into a recomputed module's class (before ``fully_shard``, so a unit's gather runs
    first: ``FSDPModule`` -> this -> the model class)."""

    _fsdp_recompute: _State

    def construct(self, *args, **kwargs):
        if not self.training:
            return super().construct(*args, **kwargs)
        st = self._fsdp_recompute
        st.slots = _weight_slots(self)
        weights = [getattr(owner, attr) for owner, attr in st.slots]   # gathered, if sharded
        return ms.recompute(st.rerun, *weights, *args, **kwargs)


def recompute_under_fsdp(cell) -> None:
    """``apply_recompute``'s marker when FSDP will be applied: make ``cell`` recompute with its
    weights as explicit inputs (called before ``fully_shard``)."""
    cls = type(cell)
    if not isinstance(cell, RecomputedUnderFSDP):
        cell.__class__ = type(f"Recomputed{cls.__name__}", (RecomputedUnderFSDP, cls), {})
    cell._fsdp_recompute = _State(cell)


def check_recompute_under_fsdp(roots: Iterable) -> None:
    """After FSDP: refuse a recomputed module containing an FSDP unit (its re-run would gather
    that unit again inside the backward; not built)."""
    for root in roots:
        for name, cell in root.cells_and_names():
            if not isinstance(cell, RecomputedUnderFSDP):
                continue
            inner = [n for n, c in cell.cells_and_names() if n and isinstance(c, FSDPModule)]
            if inner:
                raise ValueError(f"training.recompute_* with parallel.fsdp_size > 1: the "
                                 f"recomputed module {name} contains the FSDP unit "
                                 f"{name}.{inner[0]} (parallel.fsdp_modules); recomputing a "
                                 f"module around a unit is not built yet")
