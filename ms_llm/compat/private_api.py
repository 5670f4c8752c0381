"""Every private or undocumented MindSpore API ms_llm relies on, one small function each.

MindSpore can rename or drop any of these in a minor release without notice. Keeping them here
means each use is named once, says what it relies on, and fails with one line naming the API and
the installed MindSpore version when it is gone, instead of an ``AttributeError`` deep inside a
training step. ``tests/compat/test_private_api.py`` exercises every function, so an upgrade that
breaks one fails there first.

All of them were verified on MindSpore ``VERIFIED_ON``; importing this module under another
version logs one warning (the uses may still work: the tests say).

Not here on purpose: point-to-point ``send``/``recv`` on CPU. MindSpore 2.10 binds their rank
cache to the HCCL world-group name, so they fail on CPU; ``parallel.comm`` routes around that with
a ``broadcast`` in a two-rank group instead of patching the cache.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, ContextManager

import mindspore as ms

VERIFIED_ON = ("2.10",)

log = logging.getLogger("ms_llm.compat")


class PrivateAPIError(RuntimeError):
    """A private MindSpore API ms_llm relies on is missing from the installed MindSpore."""


def _missing(api: str) -> PrivateAPIError:
    return PrivateAPIError(
        f"MindSpore {ms.__version__} has no {api} (private API ms_llm relies on, verified on "
        f"MindSpore {', '.join(VERIFIED_ON)}); see ms_llm/compat/private_api.py")


def _require(owner: Any, attr: str, api: str) -> Any:
    """``owner.attr``, or a ``PrivateAPIError`` naming ``api`` and the MindSpore version."""
    try:
        return getattr(owner, attr)
    except AttributeError:
        raise _missing(api) from None


def version_verified(version: str = ms.__version__) -> bool:
    """True when ``version`` is one the private uses here were verified on."""
    return any(version == v or version.startswith(v + ".") for v in VERIFIED_ON)


if not version_verified():
    log.warning("MindSpore %s: ms_llm's private-API uses (ms_llm/compat/private_api.py) were verified "
                "on %s only; run tests/compat/test_private_api.py", ms.__version__,
                ", ".join(VERIFIED_ON))


# ----------------------------------------------------------------------------- autograd
def autograd_function_base() -> type:
    """``mindspore.common._Function``: torch.autograd.Function's shape (``forward(ctx, ...)``,
    ``backward(ctx, *grads)``, ``apply``). PyNative only; under ``jit`` use ``Cell.bprop``."""
    import mindspore.common as common
    return _require(common, "_Function", "mindspore.common._Function")


def no_grad() -> ContextManager:
    """``mindspore.common._no_grad()``: disables gradient recording in PyNative (what
    ``torch.no_grad`` does); MindSpore has no public equivalent."""
    import mindspore.common as common
    return _require(common, "_no_grad", "mindspore.common._no_grad")()


# ----------------------------------------------------------------------------- device
def device_chosen_by_caller() -> bool:
    """Whether ``mindspore.set_device`` was already called in this process: MindSpore has no
    public query, its own ``set_device`` reads ``_c_expression.DeviceManagerConf``."""
    try:
        from mindspore._c_expression import DeviceManagerConf
    except ImportError:
        raise _missing("mindspore._c_expression.DeviceManagerConf") from None
    conf = _require(DeviceManagerConf, "get_instance", "DeviceManagerConf.get_instance")()
    return bool(_require(conf, "is_device_enable", "DeviceManagerConf.is_device_enable")())


def ascend_plugin_error():
    """None when this MindSpore loaded its Ascend plugin, else the plugin's load error ('' when
    it recorded none). ``mindspore.device_context.ascend.is_available()`` answers the same
    question but only logs the error; it reads ``MSContext.load_plugin_error``."""
    try:
        from mindspore._c_expression import MSContext
    except ImportError:
        raise _missing("mindspore._c_expression.MSContext") from None
    context = _require(MSContext, "get_instance", "MSContext.get_instance")()
    if _require(context, "is_pkg_support_device", "MSContext.is_pkg_support_device")("Ascend"):
        return None
    return str(_require(context, "load_plugin_error", "MSContext.load_plugin_error")())


def ascend_soc_version() -> str:
    """The Ascend SoC CANN reports ("ascend910b", "ascend910_93", "ascend950", ...), lower
    case, '' off Ascend: ``MSContext.get_ascend_soc_version``, which MindSpore itself uses to
    pick custom-op configurations and has no public form."""
    try:
        from mindspore._c_expression import MSContext
    except ImportError:
        raise _missing("mindspore._c_expression.MSContext") from None
    context = _require(MSContext, "get_instance", "MSContext.get_instance")()
    getter = _require(context, "get_ascend_soc_version", "MSContext.get_ascend_soc_version")
    try:
        return str(getter() or "").lower()
    except RuntimeError:   # no Ascend runtime in this process
        return ""


# ----------------------------------------------------------------------------- kernels
def grouped_matmul_kernel() -> Callable:
    """MindSpore's grouped matmul ``gmm`` (Ascend kernel), which ``mindspore.ops`` does not export;
    it is reachable only through the internal module ``mindspore.ops.function.math_func``."""
    try:
        from mindspore.ops.function.math_func import gmm
    except ImportError:
        raise _missing("mindspore.ops.function.math_func.gmm") from None
    return gmm


# ----------------------------------------------------------------------------- cells
def child_cell(parent: ms.nn.Cell, name: str) -> ms.nn.Cell:
    """The direct child cell registered as ``name`` (``CellList`` entries ``"0"``, ``"1"``, ...
    included), read from ``Cell._cells``; a ``KeyError`` when there is none."""
    return _require(parent, "_cells", "Cell._cells")[name]


def shadow_attribute(cell: ms.nn.Cell, name: str, value: Any) -> None:
    """Make ``cell.<name>`` read as ``value`` while the registered Parameter stays registered.

    ``Cell.__setattr__`` refuses a plain Tensor under a Parameter's name. Cell keeps its
    Parameters in ``Cell._params``, outside the instance dict, and serves them from
    ``__getattr__``, which Python calls only when the instance dict misses; so an instance-dict
    entry shadows the Parameter for attribute reads until ``unshadow_attribute``."""
    if "_params" not in vars(cell):
        raise _missing("Cell._params (Parameters kept outside the instance dict)")
    vars(cell)[name] = value


def unshadow_attribute(cell: ms.nn.Cell, name: str) -> None:
    """Undo ``shadow_attribute``: reads of ``cell.<name>`` see the Parameter again."""
    vars(cell).pop(name, None)


# ----------------------------------------------------------------------------- storage
def _storage(t: ms.Tensor):
    return _require(t, "untyped_storage", "Tensor.untyped_storage")()


def free_storage(t: ms.Tensor) -> None:
    """Release ``t``'s bytes but keep the tensor object (``untyped_storage().resize_(0)``):
    autograd keeps the tensors it saved, and a later ``refill_storage`` makes them valid again.
    Storage-level writes do not bump version counters, so the saved-tensor check accepts them."""
    _storage(t).resize_(0)


def refill_storage(t: ms.Tensor, src: ms.Tensor) -> None:
    """Give ``t`` (freed by ``free_storage``) ``src``'s bytes again, in place."""
    s, d = _storage(src), _storage(t)
    d.resize_(s.nbytes())
    d.copy_(s)


def storage_nbytes(t: ms.Tensor) -> int:
    """Bytes ``t``'s storage holds now (0 after ``free_storage``)."""
    return int(_storage(t).nbytes())


# ----------------------------------------------------------------------------- random state
def _kernel_seed_table() -> dict:
    import importlib   # the module: the attribute ``mindspore.common.seed`` is a function
    return _require(importlib.import_module("mindspore.common.seed"), "_KERNEL_SEED",
                    "mindspore.common.seed._KERNEL_SEED")


def legacy_kernel_seeds() -> list:
    """The per-kernel seed counters of MindSpore's legacy random ops (``ops.dropout`` and the
    other ``_get_graph_seed`` users): ``[[kernel_name, op_seed, counter], ...]``. Each call of such
    an op advances its counter, and ``mindspore.get_rng_state`` does not cover them, so an exact
    resume must carry them (``ops.dropout`` is the CPU dropout path)."""
    return [[k[0], k[1], int(v)] for k, v in _kernel_seed_table().items()]


def set_legacy_kernel_seeds(entries: list) -> None:
    """Restore what ``legacy_kernel_seeds`` returned (counters not listed are dropped)."""
    table = _kernel_seed_table()
    table.clear()
    table.update({(str(name), int(op_seed)): int(v) for name, op_seed, v in entries})
