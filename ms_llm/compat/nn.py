"""torch.nn-shaped building blocks on top of ``mindspore.nn.Cell``.

Parameters are created from NumPy: MindSpore's in-place random initialisers (``normal_``,
``uniform_``) have no CPU kernel, and NumPy makes initialisation identical on every device.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, Mapping, Optional, Tuple

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn
from mindspore.common.initializer import Zero

from . import functional as F
from .private_api import child_cell, shadow_attribute, unshadow_attribute
from .dtypes import float32, to_ms_dtype

_RNG = {"gen": np.random.default_rng(0)}
_SHAPE_ONLY = {"on": False}


@contextlib.contextmanager
def shape_only() -> Iterator[None]:
    """Build modules whose parameters have shapes and dtypes but no storage (torch's ``meta``
    device): MindSpore's lazily initialised Tensors allocate nothing until read. ``ms-llm plan``
    builds a full-size model this way to count its parameters exactly without the memory."""
    prev = _SHAPE_ONLY["on"]
    _SHAPE_ONLY["on"] = True
    try:
        yield
    finally:
        _SHAPE_ONLY["on"] = prev


def manual_seed(seed: int) -> None:
    """Seed parameter initialisation (and MindSpore's own RNG, used by dropout)."""
    _RNG["gen"] = np.random.default_rng(seed)
    ms.set_seed(seed)


def rng() -> np.random.Generator:
    return _RNG["gen"]


class _UninitialisedParameter(Parameter):
    """``Parameter`` whose lazily initialised Tensor stays uninitialised: MindSpore's own
    ``Parameter(Tensor(shape=..., init=...))`` runs ``init_data()`` at once (NumPy zeros of the
    full shape: a 28 GiB array for one 671B expert weight), unless the class says
    ``init_param = False``."""
    init_param = False


def _storage_free_parameter(shape, dtype, requires_grad: bool) -> Parameter:
    """A Parameter with a shape, a dtype and no data (``shape_only``)."""
    t = Tensor(shape=tuple(shape), dtype=to_ms_dtype(dtype), init=Zero())
    # MindSpore returns an instance of its base ``Parameter`` type from ``__new__``, so Python
    # skips ``__init__`` (it is not an instance of the subclass): run it here
    p = _UninitialisedParameter(t)
    Parameter.__init__(p, t, requires_grad=requires_grad)
    return p


def new_parameter(shape, *, std: Optional[float] = None, fill: Optional[float] = None,
                  dtype=float32, requires_grad: bool = True,
                  values: Optional[Callable[[], np.ndarray]] = None) -> Parameter:
    """A Parameter drawn from N(0, std), filled with a constant, or ``values()`` (an init of its
    own, e.g. DeltaNet's ``A_log``), built in fp32 NumPy (under ``shape_only()``: a lazily
    initialised one that holds no data, and ``values`` is not called)."""
    if _SHAPE_ONLY["on"]:
        return _storage_free_parameter(shape, dtype, requires_grad)
    if values is not None:
        data = np.asarray(values(), dtype=np.float32).reshape(shape)
    elif std is not None:
        data = rng().normal(0.0, std, size=shape).astype(np.float32)
    else:
        data = np.full(shape, 0.0 if fill is None else fill, dtype=np.float32)
    t = Tensor(data)
    dtype = to_ms_dtype(dtype)
    if dtype != float32:
        t = t.astype(dtype)
    return Parameter(t, requires_grad=requires_grad)


class Module(nn.Cell):
    """A Cell that reads like ``torch.nn.Module``: subclasses define ``forward``."""

    def construct(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__}.forward is not defined")

    def named_parameters(self, prefix: str = "", recurse: bool = True
                         ) -> Iterator[Tuple[str, Parameter]]:
        # Cell.parameters_and_names yields attribute paths: exactly torch's state-dict keys.
        yield from self.parameters_and_names(name_prefix=prefix, expand=recurse)

    def named_modules(self) -> Iterator[Tuple[str, nn.Cell]]:
        yield from self.cells_and_names()

    def num_parameters(self) -> int:
        return int(sum(int(np.prod(p.shape)) for _, p in self.named_parameters()))


class ModuleList(nn.CellList):
    """torch.nn.ModuleList: children are named "0", "1", ..., as in torch state dicts."""


class Linear(Module):
    """``y = x W^T + b`` with torch's parameter names and layout (weight is [out, in])."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 init_std: float = 0.02, dtype=float32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = new_parameter((out_features, in_features), std=init_std, dtype=dtype)
        self.bias = new_parameter((out_features,), fill=0.0, dtype=dtype) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def extend_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}"


class Embedding(Module):
    """``weight[ids]`` with torch's parameter name and layout (weight is [num, dim])."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_std: float = 0.02,
                 dtype=float32):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = new_parameter((num_embeddings, embedding_dim), std=init_std, dtype=dtype)

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.weight)


def state_dict(module: nn.Cell) -> Dict[str, Parameter]:
    """Name -> Parameter, names being attribute paths (torch/Megatron state-dict keys)."""
    return dict(module.parameters_and_names())


def load_state_dict(module: nn.Cell, state: Mapping[str, object], strict: bool = True,
                    source: str = "state dict") -> Tuple[list, list]:
    """Copy arrays/tensors into the module's parameters, in place (Parameter objects are kept).

    Returns ``(missing, unexpected)``. With ``strict`` either being non-empty, or any shape
    mismatch, raises a one-line error naming ``source`` and the key.
    """
    own = state_dict(module)
    missing = sorted(k for k in own if k not in state)
    unexpected = sorted(k for k in state if k not in own)
    if strict and (missing or unexpected):
        raise KeyError(f"{source}: missing keys {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                       f"unexpected keys {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    for name, param in own.items():
        if name not in state:
            continue
        value = state[name]
        if isinstance(value, np.ndarray):
            value = Tensor(np.ascontiguousarray(value))
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"{source}: key {name!r} has shape {tuple(value.shape)}, "
                             f"model expects {tuple(param.shape)}")
        # astype to the same dtype shares storage: copy, so later in-place updates of either
        # side never leak into the other (torch's load_state_dict copies too).
        param.set_data(F.clone(value.astype(param.dtype)))
    return missing, unexpected


def shadow_parameter(module: nn.Cell, name: str, value) -> None:
    """Make ``module.<name>`` read as ``value`` (e.g. an all-gathered full weight) while the
    registered Parameter (e.g. this rank's shard) stays what optimizers and state dicts see.

    torch's FSDP2 swaps a module's parameter for its unsharded tensor with ``setattr``; MindSpore's
    ``Cell.__setattr__`` refuses a plain Tensor under a registered Parameter name, so the value
    shadows the Parameter instead (``private_api.shadow_attribute``: it relies on how Cell stores
    Parameters) until ``unshadow_parameter`` removes it."""
    shadow_attribute(module, name, value)


def unshadow_parameter(module: nn.Cell, name: str) -> None:
    """Undo ``shadow_parameter``: ``module.<name>`` reads as the registered Parameter again."""
    unshadow_attribute(module, name)


def set_submodule(root: nn.Cell, target: str, module: nn.Cell) -> None:
    """torch's ``Module.set_submodule``: put ``module`` at the dotted path ``target`` under
    ``root`` (``ModuleList`` entries ``"0"``, ``"1"``, ... included). The module conversions
    (MXFP8 in ``quant``, adapters in ``lora``) swap the modules they select this way."""
    parent_name, _, child = target.rpartition(".")
    parent = root
    for part in parent_name.split(".") if parent_name else []:
        parent = child_cell(parent, part)
    parent.insert_child_to_cell(child, module)
