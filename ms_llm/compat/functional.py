"""Torch-named tensor functions, each routed to a MindSpore kernel that exists on the device.

See the table in ``ms_llm.compat``'s docstring for every fallback and why it is needed.
"""
from __future__ import annotations

import builtins
import contextlib
from typing import Optional, Sequence, Union

import numpy as np
import mindspore as ms
from mindspore import Tensor, mint, ops

from . import private_api
from .device import is_cpu
from .dtypes import bfloat16, float32, to_ms_dtype

_Shape = Union[int, Sequence[int]]
builtins_sum = builtins.sum


def _shape(size) -> tuple:
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        return tuple(size[0])
    return tuple(size)


def _fp32_on_cpu(*xs: Tensor):
    """MindSpore's CPU backend has no bf16 compute kernels (matmul, softmax, exp, reductions...):
    compute such inputs in fp32. Returns the (possibly upcast) inputs and the dtype to cast back to.
    (Plain loops, no generator expressions: this must also parse under ``mindspore.jit``.)"""
    if not is_cpu():
        return xs, None
    low = False
    for x in xs:
        if x is not None and x.dtype == ms.bfloat16:
            low = True
    if not low:
        return xs, None
    out = []
    for x in xs:
        out.append(None if x is None else x.astype(ms.float32))
    return tuple(out), ms.bfloat16


def _back(y: Tensor, dtype) -> Tensor:
    return y if dtype is None else y.astype(dtype)


# ----------------------------------------------------------------------------- creation
def tensor(data, dtype=None) -> Tensor:
    """torch.tensor: Python floats become float32 (torch's default dtype); arrays keep theirs."""
    arr = np.asarray(data)
    if dtype is None and not isinstance(data, np.ndarray) and arr.dtype == np.float64:
        arr = arr.astype(np.float32)
    t = Tensor(arr)
    return t if dtype is None else t.astype(to_ms_dtype(dtype))


def from_numpy(arr: np.ndarray) -> Tensor:
    return Tensor(np.ascontiguousarray(arr))


def zeros(*size, dtype=float32) -> Tensor:
    return mint.zeros(_shape(size), dtype=to_ms_dtype(dtype))


def ones(*size, dtype=float32) -> Tensor:
    return mint.ones(_shape(size), dtype=to_ms_dtype(dtype))


def empty(*size, dtype=float32) -> Tensor:
    return mint.empty(_shape(size), dtype=to_ms_dtype(dtype))


def full(size: _Shape, fill_value, dtype=float32) -> Tensor:
    # mint.full: no CPU kernel (FillScalar); ops.full has no bf16 kernel on CPU.
    dtype = to_ms_dtype(dtype)
    if is_cpu():
        build = float32 if dtype == bfloat16 else dtype
        return ops.full(tuple(size) if not isinstance(size, int) else (size,), fill_value,
                        dtype=build).astype(dtype)
    return mint.full(tuple(size) if not isinstance(size, int) else (size,), fill_value, dtype=dtype)


def zeros_like(x: Tensor, dtype=None) -> Tensor:
    # mint.zeros_like: no CPU kernel (ZerosLikeExt).
    return mint.zeros(x.shape, dtype=to_ms_dtype(dtype) if dtype is not None else x.dtype)


def ones_like(x: Tensor, dtype=None) -> Tensor:
    # mint.ones_like: no CPU kernel (OnesLikeExt).
    return mint.ones(x.shape, dtype=to_ms_dtype(dtype) if dtype is not None else x.dtype)


def full_like(x: Tensor, fill_value, dtype=None) -> Tensor:
    return full(x.shape, fill_value, dtype=dtype if dtype is not None else x.dtype)


def arange(start, end=None, step=1, dtype=None) -> Tensor:
    # mint.arange: no CPU kernel (Arange) in PyNative.
    if end is None:
        start, end = 0, start
    fn = ops.arange if is_cpu() else mint.arange
    t = fn(start, end, step)
    return t if dtype is None else t.astype(to_ms_dtype(dtype))


# ----------------------------------------------------------------------------- shape
def cat(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    return mint.cat(list(tensors), dim)


def stack(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    # mint.stack: no CPU kernel (StackExt).
    return (ops.stack if is_cpu() else mint.stack)(list(tensors), dim)


def tril(x: Tensor, diagonal: int = 0) -> Tensor:
    return (ops.tril if is_cpu() else mint.tril)(x, diagonal)


def triu(x: Tensor, diagonal: int = 0) -> Tensor:
    return (ops.triu if is_cpu() else mint.triu)(x, diagonal)


_SPLIT_GRAD_BUG = ms.__version__.startswith("2.10.")


def split(x: Tensor, split_size_or_sections, dim: int = 0):
    """torch.split. Workaround for a MindSpore 2.10 PyNative autograd bug: the gradient of a
    ``mint.split`` output that is then transposed (swapaxes/permute/transpose) comes back
    *reshaped* instead of transposed, silently corrupting K/V gradients in attention
    (``tests/compat/test_compat.py::test_mindspore_split_transpose_grad_bug`` shows it and fails
    once MindSpore fixes it). ``mint.narrow`` pieces differentiate correctly."""
    if not _SPLIT_GRAD_BUG:
        return mint.split(x, split_size_or_sections, dim)
    size = x.shape[dim]
    if isinstance(split_size_or_sections, int):
        step = split_size_or_sections
        sections = [min(step, size - s) for s in range(0, size, step)]
    else:
        sections = list(split_size_or_sections)
        if builtins_sum(sections) != size:
            raise ValueError(f"split: sections {sections} do not add up to size {size} of dim {dim}")
    out, start = [], 0
    for n in sections:
        out.append(mint.narrow(x, dim, start, n))
        start += n
    return tuple(out)


_VIEW_COPY_BUG = ms.__version__.startswith("2.10.")


def copy_(dst: Tensor, src: Tensor) -> Tensor:
    """torch's ``dst.copy_(src)``. Workaround for a MindSpore 2.10 bug: ``copy_`` from a view that
    starts at offset 0 of a larger tensor (e.g. ``mint.narrow(buf, 0, 0, n)``) fails with "For
    'InplaceCopy, an unexpected kernel has been launched ... mem_size" (shown by
    ``tests/compat/test_compat.py::test_mindspore_view_copy_bug``); cloning the source first avoids
    it. Only a source that is part of a larger storage is cloned: a whole tensor (e.g. the fresh
    cast of an fp32 main parameter) is copied directly, which on CPU moves bf16 at ~20 GB/s where
    a bf16 clone costs a MindSpore bf16 kernel (~13 ns per element)."""
    dst.copy_(clone(src) if _VIEW_COPY_BUG and _part_of_larger_storage(src) else src)
    return dst


def owns_storage(t: Tensor) -> bool:
    """True when ``t`` is its whole buffer (not a view into a larger one): a C kernel may then
    write through it in place."""
    return not _part_of_larger_storage(t)


def _part_of_larger_storage(t: Tensor) -> bool:
    """True when ``t`` is a view into a larger buffer (or when MindSpore cannot say)."""
    try:
        return t.untyped_storage().nbytes() != t.nbytes
    except (AttributeError, RuntimeError, TypeError):
        return True


def clone(x: Tensor) -> Tensor:
    """torch's ``x.clone()``: a fresh tensor with its own storage, same dtype. ``mint.clone`` has
    no CPU kernel, and MindSpore 2.10's ``Tensor.copy()`` moves ~0.8 GB/s on CPU against ~14 GB/s
    for an elementwise kernel (24 MB: 29.8 vs 1.7 ms), so on CPU it is ``x * 1`` (exact for every
    number, -0 and inf included; bool would promote, so bool keeps ``Tensor.copy``). bf16 goes
    through fp32 and back (exact: fp32 holds every bf16 value), two casts at ~1.3 ns per element
    each against ~13 for MindSpore's bf16 ``Mul`` on CPU."""
    if not is_cpu():
        return mint.clone(x)
    if x.dtype == ms.bool_:
        return x.copy()
    return x.astype(ms.float32).astype(x.dtype) if x.dtype == ms.bfloat16 else x * 1


# ----------------------------------------------------------------------------- math
def matmul(a: Tensor, b: Tensor) -> Tensor:
    (a, b), back = _fp32_on_cpu(a, b)
    return _back(mint.matmul(a, b), back)


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    (x, weight, bias), back = _fp32_on_cpu(x, weight, bias)
    return _back(mint.nn.functional.linear(x, weight, bias), back)


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    (x,), back = _fp32_on_cpu(x)
    return _back(mint.softmax(x, dim), back)


def log_softmax(x: Tensor, dim: int = -1) -> Tensor:
    # F.log_softmax: no CPU kernel (LogSoftmaxExt) in PyNative.
    (x,), back = _fp32_on_cpu(x)
    y = ops.log_softmax(x, dim) if is_cpu() else mint.nn.functional.log_softmax(x, dim)
    return _back(y, back)


def logsigmoid(x: Tensor) -> Tensor:
    """``log(sigmoid(x))`` without overflow: ``min(x, 0) - log1p(exp(-|x|))``. MindSpore 2.10
    has no CPU kernel behind ``mint.nn.functional.logsigmoid`` (LogSigmoid unregistered)."""
    (x,), back = _fp32_on_cpu(x)
    if is_cpu():
        y = mint.minimum(x, ops.zeros_like(x)) - mint.log1p(mint.exp(-mint.abs(x)))
    else:
        y = mint.nn.functional.logsigmoid(x)
    return _back(y, back)


def silu(x: Tensor) -> Tensor:
    (x,), back = _fp32_on_cpu(x)
    return _back(mint.nn.functional.silu(x), back)


def softplus(x: Tensor) -> Tensor:
    """``log(1 + exp(x))``. MindSpore 2.10's CPU backend has no ``SoftplusGradExt`` kernel, so
    there it is composed as torch computes it: ``x`` above 20, else ``log1p(exp(x))`` (the
    exponent clamped so the unused branch stays finite and its gradient is 0, not NaN)."""
    if is_cpu() and ms.__version__.startswith("2.10."):
        return mint.where(x > 20, x, mint.log1p(mint.exp(mint.clamp(x, max=20.0))))
    return mint.nn.functional.softplus(x)


def sigmoid(x: Tensor) -> Tensor:
    (x,), back = _fp32_on_cpu(x)
    return _back(mint.sigmoid(x), back)


def exp(x: Tensor) -> Tensor:
    (x,), back = _fp32_on_cpu(x)
    return _back(mint.exp(x), back)


def rsqrt(x: Tensor) -> Tensor:
    (x,), back = _fp32_on_cpu(x)
    return _back(mint.rsqrt(x), back)


def mean(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    (x,), back = _fp32_on_cpu(x)
    return _back(mint.mean(x, dim, keepdim), back)


def sum(x: Tensor, dim=None, keepdim: bool = False, dtype=None) -> Tensor:  # noqa: A001
    (x,), back = _fp32_on_cpu(x)
    y = mint.sum(x, dim, keepdim)
    if dtype is not None:
        return y.astype(to_ms_dtype(dtype))
    return _back(y, back)


def broadcast_to(x: Tensor, shape: _Shape) -> Tensor:
    """``x`` repeated along its size-1 dims; its backward sums over them, which has no bf16
    kernel on CPU ("Reduce does not support ... BFloat16"), so a bf16 input is broadcast in
    fp32 there and cast back (exact: a copy)."""
    (x,), back = _fp32_on_cpu(x)
    return _back(x.broadcast_to(_shape((shape,))), back)


def where(cond: Tensor, x, y) -> Tensor:
    return mint.where(cond, x, y)


def clamp(x: Tensor, min=None, max=None) -> Tensor:  # noqa: A002
    (x,), back = _fp32_on_cpu(x)
    return _back(mint.clamp(x, min, max), back)


def gather(x: Tensor, dim: int, index: Tensor) -> Tensor:
    (x,), back = _fp32_on_cpu(x)
    return _back(mint.gather(x, dim, index), back)


def embedding(ids: Tensor, weight: Tensor) -> Tensor:
    # F.embedding / mint.nn.Embedding: no CPU kernel (Embedding) and no CPU backward under jit;
    # a row gather accumulates duplicate-id gradients correctly.
    if is_cpu():
        (weight,), back = _fp32_on_cpu(weight)
        return _back(ops.gather(weight, ids, 0), back)
    return mint.nn.functional.embedding(ids, weight)


def argmax(x: Tensor, dim: int = -1) -> Tensor:
    # mint.argmax: no CPU kernel (ArgMaxExt).
    (x,), _ = _fp32_on_cpu(x)
    return (ops.argmax if is_cpu() else mint.argmax)(x, dim)


def topk(x: Tensor, k: int, dim: int = -1):
    # mint.topk: no CPU kernel (TopkExt); ops.topk returns int32 indices.
    (x,), back = _fp32_on_cpu(x)
    if is_cpu():
        values, idx = ops.topk(x, k, dim)
        return _back(values, back), idx.astype(ms.int64)
    values, idx = mint.topk(x, k, dim)
    return _back(values, back), idx


def cumsum(x: Tensor, dim: int) -> Tensor:
    # mint.cumsum: no CPU kernel (CumsumExt).
    return (ops.cumsum if is_cpu() else mint.cumsum)(x, dim)


def one_hot(ids: Tensor, num_classes: int, dtype=float32) -> Tensor:
    # F.one_hot: no CPU kernel (OneHotExt).
    dtype = to_ms_dtype(dtype)
    on, off = Tensor(1.0, float32), Tensor(0.0, float32)
    return ops.one_hot(ids, num_classes, on, off).astype(dtype)


def stop_gradient(x: Tensor) -> Tensor:
    return ops.stop_gradient(x)


# ----------------------------------------------------------------------------- autograd
@contextlib.contextmanager
def no_grad():
    """torch.no_grad: nothing computed inside contributes gradients."""
    with private_api.no_grad():   # MindSpore has no public equivalent
        yield


def gelu(x: Tensor) -> Tensor:
    # F.gelu: no CPU kernel (GeluExt); ops.gelu(approximate="none") is the exact erf form.
    (x,), back = _fp32_on_cpu(x)
    y = ops.gelu(x, approximate="none") if is_cpu() else mint.nn.functional.gelu(x)
    return _back(y, back)


def dropout(x: Tensor, p: float = 0.5, training: bool = True) -> Tensor:
    # F.dropout / mint.nn.Dropout: no CPU kernel (DropoutExt) in training mode.
    if not training or p == 0.0:
        return x
    (x,), back = _fp32_on_cpu(x)
    y = ops.dropout(x, p) if is_cpu() else mint.nn.functional.dropout(x, p, training=True)
    return _back(y, back)
