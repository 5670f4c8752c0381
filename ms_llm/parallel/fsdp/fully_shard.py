"""``fully_shard``: per-parameter dim-0 sharding of a module's parameters over a process group.

After ``fully_shard(module)`` the module's registered Parameters hold only this rank's real rows
(the optimizer and the state dict see nothing else). Execution follows torch FSDP2:

* Forward: one flat all-gather per unit (``flat.FlatLayout``: every parameter's padded shard in
  one buffer), copy-out into fresh full tensors that the module reads through
  ``compat.nn.shadow_parameter``. The gather is one custom-backward function per unit.
* ``reshard_after_forward``: after the unit's forward the full tensors' *storage* is freed
  (``untyped_storage().resize_(0)``: autograd keeps the tensor objects it saved, without their
  bytes) and refilled from a new all-gather when the unit's backward begins (an identity
  function on the unit's outputs, torch's pre-backward hook). No forward is recomputed. Storage
  level writes do not bump the tensors' version counters, which is what makes the refill legal
  for MindSpore's saved-tensor check. Units containing an MoE layer keep their weights gathered
  instead: their router's auxiliary loss sends gradient into the unit around its outputs, so the
  pre-backward hook could fire after the router's backward read the weights.
* Backward: the gather's backward packs the unit's full gradients into one flat input and starts
  one asynchronous reduce-scatter; each sharded Parameter's gradient is a view of its output,
  filled when the last unit of the backward pass waits for every outstanding reduce-scatter (so
  communication overlaps the rest of backward, and the gradients are complete when
  ``value_and_grad`` returns).
* Prefetch: the next units' all-gathers start before this unit computes (forward) or when this
  unit's backward begins (backward).

Runs in PyNative (custom backward); the trainer refuses ``training.jit`` with FSDP.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence

from mindspore import Parameter, Tensor, mint

from ms_llm.compat import F, float32, to_ms_dtype
from ms_llm.compat.private_api import free_storage, refill_storage
from ms_llm.compat.autograd import Function
from ms_llm.compat.nn import shadow_parameter, unshadow_parameter
from .. import comm
from ..placement import RowShard, add_shard, placement_of, set_placement
from .flat import FlatLayout


# Seconds this process spent blocked in FSDP's collectives (read by benchmarks/fsdp_memory.py to
# show how much communication the overlap hides); plain counters, reset by the caller.
WAIT_SECONDS = {"all_gather": 0.0, "reduce_scatter": 0.0}


def _wait(work, kind: str) -> None:
    t0 = time.perf_counter()
    work.wait()
    WAIT_SECONDS[kind] += time.perf_counter() - t0


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtype of the gathered weights used in compute and of the gradient reduce-scatter
    (None = the parameter's own dtype / float32). Sharded master parameters stay as they are."""
    param_dtype: Optional[str] = None
    reduce_dtype: Optional[str] = None


class _FSDPParam:
    """One sharded parameter: where it lives in the module tree and how it is split."""

    def __init__(self, owner, attr: str, param: Parameter, group: comm.ProcessGroup,
                 mesh_dim: str = "dp"):
        self.owner, self.attr = owner, attr
        self.full_shape = tuple(param.shape)
        self.shard = RowShard(self.full_shape[0], group.size, group.rank)
        data = param.asnumpy()
        local = data[self.shard.start:self.shard.start + self.shard.length]
        self.param = Parameter(Tensor(local.copy()).astype(param.dtype), name=param.name,
                               requires_grad=param.requires_grad)
        # The shard's rows follow from the record (the chunk rule over the group's mesh dim).
        set_placement(self.param, add_shard(param, self.full_shape, mesh_dim, 0))
        setattr(owner, attr, self.param)     # replaces the registered Parameter, same name
        self.pending_grad: Optional[Tensor] = None   # full-size grads while sync is off


class _StepContext:
    """Shared by every unit of one ``fully_shard`` tree: counts the units' gathers in this
    forward and their backwards, and waits for the reduce-scatters after the last one."""

    def __init__(self, owner: "_FSDPState"):
        self.owner = owner
        self.states: List["_FSDPState"] = [owner]
        self.expected = self.done = 0
        self.pending: list = []            # (work, flat out, param-dtype result, flat in)

    def begin_forward(self) -> None:
        if self.pending:
            self.drain()
            raise RuntimeError("FSDP: reduce-scatters of the previous backward were still "
                               "pending at the next forward (some unit gathered in forward got "
                               "no backward), so its gradients were incomplete when read")
        for st in self.states:       # a prefetch nobody consumed holds last step's weights
            if st.prefetched is not None:
                _wait(st.prefetched[0], "all_gather")
                st.prefetched = None
        self.expected = self.done = 0

    def unit_backward_done(self) -> None:
        self.done += 1
        if self.done >= self.expected:
            self.drain()

    def launch(self, entry: tuple) -> None:
        """Queue a unit's reduce-scatter; the previous one (which had this unit's backward to
        finish in) is completed first, so at most one unit's flat gradients are in flight."""
        self.drain()
        self.pending.append(entry)

    def drain(self) -> None:
        pending, self.pending = self.pending, []
        for work, out, res, _ in pending:
            _wait(work, "reduce_scatter")
            if res is not out:
                F.copy_(res, out.astype(res.dtype))


class _GatherUnit(Function):
    """Forward: the unit's full parameters (one all-gather). Backward: one reduce-scatter."""

    @staticmethod
    def forward(ctx, st, *shards):
        ctx.st = st
        st.ctx.expected += 1
        return tuple(st.unshard_for_forward())

    @staticmethod
    def backward(ctx, *grads):
        st = ctx.st
        views = st.reduce_grads(list(grads))
        st.fulls = None
        st.ctx.unit_backward_done()
        return (None,) + tuple(views)


class _PreBackward(Function):
    """Identity on a unit's outputs whose backward re-gathers the freed weights first."""

    @staticmethod
    def forward(ctx, st, *tensors):
        ctx.st = st
        return tuple(t * 1 for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.st.refill_for_backward()
        ctx.st.prefetch_for_backward()
        return (None,) + tuple(grads)


class _FSDPState:
    def __init__(self, module, group, reshard_after_forward: bool,
                 mp_policy: MixedPrecisionPolicy, ignored: set, mesh_dim: str = "dp"):
        self.group = group
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy = mp_policy
        self.requires_grad_sync = True
        self.forward_prefetch: List["FSDPModule"] = []
        self.backward_prefetch: List["FSDPModule"] = []
        self.fparams: List[_FSDPParam] = []
        self.keep_gathered = False
        from ms_llm.models.moe import MoELayer
        for owner_name, owner in module.cells_and_names():
            if owner is not module and isinstance(owner, FSDPModule):
                continue
            if _inside_other_unit(module, owner_name):
                continue
            self.keep_gathered |= isinstance(owner, MoELayer)
            for attr, p in list(owner.parameters_and_names(expand=False)):
                attr = attr.rsplit(".", 1)[-1]
                if id(p) in ignored or placement_of(p).dp_cut or not p.requires_grad:
                    continue
                self.fparams.append(_FSDPParam(owner, attr, p, group, mesh_dim))
        dtypes = {fp.param.dtype for fp in self.fparams}
        if len(dtypes) > 1:
            raise ValueError(f"fully_shard({type(module).__name__}): its parameters mix dtypes "
                             f"{sorted(map(str, dtypes))}; one flat buffer per unit needs one "
                             f"dtype (shard the odd ones in their own unit)")
        self.layout = FlatLayout([fp.full_shape for fp in self.fparams], group.size, group.rank)
        self.ctx = _StepContext(self)
        self.prefetched = None            # (Work, gathered flat parts) of an async all-gather
        self.fulls: Optional[List[Tensor]] = None
        self.freed = False

    # ------------------------------------------------------------------ dtypes
    def param_dtype(self):
        return to_ms_dtype(self.mp_policy.param_dtype) or self.fparams[0].param.dtype

    def reduce_dtype(self):
        return to_ms_dtype(self.mp_policy.reduce_dtype) or float32

    # ------------------------------------------------------------------ all-gather
    def start_gather(self) -> tuple:
        dtype = self.param_dtype()
        flat = self.layout.pack_shards([fp.param for fp in self.fparams], dtype)
        parts = [mint.zeros((self.layout.numel,), dtype=dtype) for _ in range(self.group.size)]
        work = comm.all_gather(parts, flat, group=self.group, async_op=True)
        return work, parts

    def prefetch(self) -> None:
        if self.prefetched is None and self.fparams:
            self.prefetched = self.start_gather()

    def gathered(self) -> List[Tensor]:
        work, parts = self.prefetched if self.prefetched is not None else self.start_gather()
        self.prefetched = None
        _wait(work, "all_gather")
        return self.layout.unpack_full(parts)

    def unshard_for_forward(self) -> List[Tensor]:
        self.fulls, self.freed = self.gathered(), False
        return self.fulls

    def free_fulls(self) -> None:
        for t in self.fulls:
            free_storage(t)
        self.freed = True

    def refill_for_backward(self) -> None:
        if not self.freed:
            return
        for t, new in zip(self.fulls, self.gathered()):
            refill_storage(t, new)
        self.freed = False

    def prefetch_for_backward(self) -> None:
        """Start the all-gathers of the units whose backward comes next (if they were freed)."""
        for unit in self.backward_prefetch:
            st = unit._fsdp_state
            if st.freed:
                st.prefetch()

    # ------------------------------------------------------------------ reduce-scatter
    def reduce_grads(self, grads: List[Tensor]) -> List[Tensor]:
        fps = self.fparams
        grads = [mint.zeros(fp.full_shape, dtype=fp.param.dtype) if g is None else g
                 for fp, g in zip(fps, grads)]
        if not self.requires_grad_sync:
            for fp, g in zip(fps, grads):
                fp.pending_grad = g if fp.pending_grad is None else fp.pending_grad + g
            return [mint.zeros(fp.param.shape, dtype=fp.param.dtype) for fp in fps]
        for i, fp in enumerate(fps):
            if fp.pending_grad is not None:
                grads[i], fp.pending_grad = grads[i] + fp.pending_grad, None
        rd = self.reduce_dtype()
        flat_in = self.layout.pack_grads(grads, rd)
        out = mint.zeros((self.layout.numel,), dtype=rd)
        work = comm.reduce_scatter_tensor(out, flat_in, group=self.group, async_op=True)
        pdt = fps[0].param.dtype
        res = out if rd == pdt else mint.zeros((self.layout.numel,), dtype=pdt)
        self.ctx.launch((work, out, res, flat_in))
        return self.layout.shard_views(res)


def _inside_other_unit(root, name: str) -> bool:
    """True when the submodule at dotted ``name`` sits under a nested FSDP unit of ``root``."""
    cell, parts = root, name.split(".") if name else []
    for part in parts[:-1]:
        cell = getattr(cell, part)
        if isinstance(cell, FSDPModule) and cell is not root:
            return True
    return False


def _wrap_outputs(st: _FSDPState, out):
    """Route the unit's floating-point outputs through ``_PreBackward`` (same structure)."""
    if isinstance(out, Tensor):
        return _PreBackward.apply(st, out)[0] if _is_float(out) else out
    if isinstance(out, (tuple, list)):
        idx = [i for i, t in enumerate(out) if isinstance(t, Tensor) and _is_float(t)]
        if not idx:
            return out
        wrapped = _PreBackward.apply(st, *[out[i] for i in idx])
        items = list(out)
        for i, w in zip(idx, wrapped):
            items[i] = w
        return type(out)(items)
    raise TypeError(f"fully_shard: cannot attach the pre-backward hook to a "
                    f"{type(out).__name__} output; return a Tensor or a tuple of Tensors")


def _is_float(t: Tensor) -> bool:
    return "float" in str(t.dtype).lower()


class FSDPModule:
    """Mixed into a module's class by ``fully_shard`` (as torch's FSDP2 does)."""

    _fsdp_state: _FSDPState

    def construct(self, *args, **kwargs):
        st = self._fsdp_state
        if st.ctx.owner is st:
            st.ctx.begin_forward()
        # Overlap the next units' all-gathers with this unit's compute.
        for unit in st.forward_prefetch:
            unit._fsdp_state.prefetch()
        if not st.fparams:
            return super().construct(*args, **kwargs)
        fulls = _GatherUnit.apply(st, *[fp.param for fp in st.fparams])
        for fp, full in zip(st.fparams, fulls):
            shadow_parameter(fp.owner, fp.attr, full)
        try:
            out = super().construct(*args, **kwargs)
        finally:
            for fp in st.fparams:
                unshadow_parameter(fp.owner, fp.attr)
        if not self.training:
            st.fulls = None
            return out
        frees = st.reshard_after_forward and not st.keep_gathered
        # The hook also serves a unit that keeps its weights (e.g. the last one) but whose
        # backward should start the next units' all-gathers.
        if frees or any(u._fsdp_state.reshard_after_forward for u in st.backward_prefetch):
            out = _wrap_outputs(st, out)
        if frees:
            st.free_fulls()
        return out

    # torch FSDP2 API --------------------------------------------------------------------
    def unshard(self) -> None:
        """Expose the full weights for reading (e.g. evaluation, export) until ``reshard()``."""
        st = self._fsdp_state
        for fp, full in zip(st.fparams, st.gathered() if st.fparams else []):
            shadow_parameter(fp.owner, fp.attr, full)

    def reshard(self) -> None:
        for fp in self._fsdp_state.fparams:
            unshadow_parameter(fp.owner, fp.attr)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """False: keep full-size gradients locally (no reduce-scatter) until sync is re-enabled,
        e.g. for all but the last micro-batch of a step."""
        cells = self.cells_and_names() if recurse else [("", self)]
        for _, cell in cells:
            if isinstance(cell, FSDPModule):
                cell._fsdp_state.requires_grad_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool) -> None:
        self._fsdp_state.reshard_after_forward = reshard_after_forward

    def set_modules_to_forward_prefetch(self, modules: Sequence["FSDPModule"]) -> None:
        self._fsdp_state.forward_prefetch = list(modules)

    def set_modules_to_backward_prefetch(self, modules: Sequence["FSDPModule"]) -> None:
        """Units whose all-gather starts when this unit's backward begins (before their own
        backward needs the weights)."""
        self._fsdp_state.backward_prefetch = list(modules)


def fully_shard(module, mesh: Optional[comm.ProcessGroup] = None, *,
                reshard_after_forward: bool = True,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                ignored_params: Optional[Iterable[Parameter]] = None, mesh_dim: str = "dp"):
    """Shard ``module``'s parameters (those not already in a nested unit) over ``mesh`` (a process
    group; default: the world). Apply to children first, then to the root, as in torch: the
    outermost call's unit owns the step bookkeeping of every unit inside it. ``mesh_dim``
    names the group in the shards' ``Placement`` (``dp``, or ``dp_cp`` when the group is data
    x context parallel), from which checkpoint regions and gradient groups are derived."""
    group = mesh if mesh is not None else comm.world_group()
    ignored = {id(p) for p in (ignored_params or ())}
    cls = type(module)
    if not isinstance(module, FSDPModule):
        module.__class__ = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    st = _FSDPState(module, group, reshard_after_forward, mp_policy, ignored, mesh_dim)
    module._fsdp_state = st
    for _, cell in module.cells_and_names():
        if isinstance(cell, FSDPModule) and cell is not module:
            inner = cell._fsdp_state
            if inner.ctx.owner is inner:
                st.ctx.states.extend(inner.ctx.states)
            for s in inner.ctx.states:
                s.ctx = st.ctx
    return module
