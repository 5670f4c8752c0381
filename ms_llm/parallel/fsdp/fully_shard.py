"""``fully_shard``: per-parameter dim-0 sharding of a module's parameters over a process group.

After ``fully_shard(module)`` the module's registered Parameters hold only this rank's real rows
(the optimizer and the state dict see nothing else). Its forward all-gathers the full weights into
padded buffers, narrows them, and lets the module read them through ``compat.nn.shadow_parameter``;
the gather is a custom-backward function whose backward pads the gradient with a zero tail and
reduce-scatters it, so a unit's gradients are reduced as soon as its backward is done.
``reshard_after_forward`` runs the unit's forward under non-reentrant recompute: the gathered
weights are dropped after forward and gathered again for backward (the recomputed forward).
Forward prefetch starts the next unit's all-gather asynchronously before this unit computes;
backward prefetch starts the previous unit's all-gather when this unit's backward is done.
Runs in PyNative (custom backward); the trainer refuses ``training.jit`` with FSDP.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence

import mindspore as ms
from mindspore import Parameter, Tensor, mint

from ms_llm.compat import float32, to_ms_dtype
from ms_llm.compat.autograd import Function
from ms_llm.compat.nn import shadow_parameter, unshadow_parameter
from .. import comm
from .sharding import RowShard


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtype of the gathered weights used in compute and of the gradient reduce-scatter
    (None = the parameter's own dtype). Sharded master parameters stay as they are (fp32)."""
    param_dtype: Optional[str] = None
    reduce_dtype: Optional[str] = None


class _FSDPParam:
    """One sharded parameter: where it lives in the module tree and how it is split."""

    def __init__(self, owner, attr: str, param: Parameter, group: comm.ProcessGroup):
        self.owner, self.attr, self.group = owner, attr, group
        self.full_shape = tuple(param.shape)
        self.shard = RowShard(self.full_shape[0], group.size, group.rank)
        data = param.asnumpy()
        local = data[self.shard.start:self.shard.start + self.shard.length]
        self.param = Parameter(Tensor(local.copy()).astype(param.dtype), name=param.name,
                               requires_grad=param.requires_grad)
        for flag in ("tensor_model_parallel", "tp_partial_grad", "tp_dim", "tp_glu",
                     "dcp_row_width", "expert_parallel", "expert_index", "expert_shard"):
            if hasattr(param, flag):
                setattr(self.param, flag, getattr(param, flag))
        self.param.fsdp_sharded = True
        self.param.fsdp_rows = (self.shard.start, self.shard.length, self.full_shape[0])
        setattr(owner, attr, self.param)     # replaces the registered Parameter, same name
        self.prefetched = None               # (Work, padded buffer) of an async all-gather
        self.pending_grad = None             # full-size grads kept while gradient sync is off

    def start_gather(self, dtype) -> tuple:
        """Launch the all-gather of the padded shard; returns (work, padded output)."""
        tail = self.full_shape[1:]
        shard = self.param.astype(dtype) if dtype != self.param.dtype else self.param
        if self.shard.length < self.shard.chunk:   # uneven: pad to C rows (maybe from 0 rows)
            pad = mint.zeros((self.shard.chunk - self.shard.length,) + tail, dtype=dtype)
            shard = mint.cat([shard, pad], 0) if self.shard.length else pad
        out = mint.zeros((self.shard.padded_rows,) + tail, dtype=dtype)
        work = comm.all_gather_into_tensor(out, shard, group=self.group, async_op=True)
        return work, out

    def gathered(self, dtype) -> Tensor:
        work, out = self.prefetched if self.prefetched is not None else self.start_gather(dtype)
        self.prefetched = None
        work.wait()
        return out if self.shard.even else mint.narrow(out, 0, 0, self.full_shape[0])

    def reduce_grad(self, full_grad: Tensor, reduce_dtype, sync: bool) -> Tensor:
        if not sync:
            self.pending_grad = full_grad if self.pending_grad is None \
                else self.pending_grad + full_grad
            return mint.zeros(self.param.shape, dtype=self.param.dtype)
        if self.pending_grad is not None:
            full_grad = full_grad + self.pending_grad
            self.pending_grad = None
        g = full_grad.astype(reduce_dtype)
        tail = self.full_shape[1:]
        if not self.shard.even:
            pad = mint.zeros((self.shard.padded_rows - self.full_shape[0],) + tail, dtype=g.dtype)
            g = mint.cat([g, pad], 0)
        out = mint.zeros((self.shard.chunk,) + tail, dtype=g.dtype)
        comm.reduce_scatter_tensor(out, g, group=self.group)
        if self.shard.length < self.shard.chunk:
            out = mint.narrow(out, 0, 0, self.shard.length)
        return out.astype(self.param.dtype)


class _GatherParam(Function):
    @staticmethod
    def forward(ctx, shard, fp, unit):
        ctx.fp, ctx.unit = fp, unit
        return fp.gathered(unit.param_dtype(fp))

    @staticmethod
    def backward(ctx, grad):
        fp, unit = ctx.fp, ctx.unit
        if fp is unit.fparams[0]:
            unit.prefetch_for_backward()
        return fp.reduce_grad(grad, unit.reduce_dtype(fp), unit.requires_grad_sync), None, None


class _FSDPState:
    def __init__(self, module, group, reshard_after_forward: bool,
                 mp_policy: MixedPrecisionPolicy, ignored: set):
        self.group = group
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy = mp_policy
        self.requires_grad_sync = True
        self.forward_prefetch: List["FSDPModule"] = []
        self.backward_prefetch: List["FSDPModule"] = []
        self.fparams: List[_FSDPParam] = []
        for owner_name, owner in module.cells_and_names():
            if owner is not module and isinstance(owner, FSDPModule):
                continue
            if _inside_other_unit(module, owner_name):
                continue
            for attr, p in list(owner.parameters_and_names(expand=False)):
                attr = attr.rsplit(".", 1)[-1]
                if id(p) in ignored or getattr(p, "fsdp_sharded", False) or not p.requires_grad:
                    continue
                self.fparams.append(_FSDPParam(owner, attr, p, group))

    def prefetch_for_backward(self) -> None:
        """Start the all-gathers of the units whose backward comes next. Only units that
        reshard after forward gather again (in their recomputed forward) and can use them."""
        for unit in self.backward_prefetch:
            st = unit._fsdp_state
            if not st.reshard_after_forward:
                continue
            for fp in st.fparams:
                if fp.prefetched is None:
                    fp.prefetched = fp.start_gather(st.param_dtype(fp))

    def param_dtype(self, fp: _FSDPParam):
        return to_ms_dtype(self.mp_policy.param_dtype) or fp.param.dtype

    def reduce_dtype(self, fp: _FSDPParam):
        return to_ms_dtype(self.mp_policy.reduce_dtype) or float32


def _inside_other_unit(root, name: str) -> bool:
    """True when the submodule at dotted ``name`` sits under a nested FSDP unit of ``root``."""
    cell, parts = root, name.split(".") if name else []
    for part in parts[:-1]:
        cell = getattr(cell, part)
        if isinstance(cell, FSDPModule) and cell is not root:
            return True
    return False


class FSDPModule:
    """Mixed into a module's class by ``fully_shard`` (as torch's FSDP2 does)."""

    _fsdp_state: _FSDPState

    def construct(self, *args, **kwargs):
        st = self._fsdp_state
        # Overlap the next units' all-gathers with this unit's compute. Only here, in the real
        # forward: the recomputed forward during backward must not prefetch (stale next step).
        for unit in st.forward_prefetch:
            for fp in unit._fsdp_state.fparams:
                if fp.prefetched is None:
                    fp.prefetched = fp.start_gather(unit._fsdp_state.param_dtype(fp))
        if st.reshard_after_forward and self.training:
            # early_stop=False: the early-stop exception does not survive custom-backward ops.
            return ms.recompute(self._fsdp_forward, *args, use_reentrant=False,
                                early_stop=False, **kwargs)
        return self._fsdp_forward(*args, **kwargs)

    def _fsdp_forward(self, *args, **kwargs):
        st = self._fsdp_state
        fulls = [_GatherParam.apply(fp.param, fp, st) for fp in st.fparams]
        for fp, full in zip(st.fparams, fulls):
            shadow_parameter(fp.owner, fp.attr, full)
        try:
            return super().construct(*args, **kwargs)
        finally:
            for fp in st.fparams:
                unshadow_parameter(fp.owner, fp.attr)

    # torch FSDP2 API --------------------------------------------------------------------
    def unshard(self) -> None:
        """Expose the full weights for reading (e.g. evaluation, export) until ``reshard()``."""
        st = self._fsdp_state
        for fp in st.fparams:
            shadow_parameter(fp.owner, fp.attr, fp.gathered(st.param_dtype(fp)))

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
        """Units whose all-gather starts when this unit's backward has produced its first
        reduced gradient (i.e. before their recomputed forward needs the weights)."""
        self._fsdp_state.backward_prefetch = list(modules)


def fully_shard(module, mesh: Optional[comm.ProcessGroup] = None, *,
                reshard_after_forward: bool = True,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                ignored_params: Optional[Iterable[Parameter]] = None):
    """Shard ``module``'s parameters (those not already in a nested unit) over ``mesh`` (a process
    group; default: the world). Apply to children first, then to the root, as in torch."""
    group = mesh if mesh is not None else comm.world_group()
    ignored = {id(p) for p in (ignored_params or ())}
    cls = type(module)
    if not isinstance(module, FSDPModule):
        module.__class__ = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    module._fsdp_state = _FSDPState(module, group, reshard_after_forward, mp_policy, ignored)
    return module
