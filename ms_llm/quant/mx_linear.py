"""Differentiable MXFP8 linear ``y = x W^T + b`` with the MX training recipe.

forward  ``Y  = X  . W^T``  X, W quantized along K
dgrad    ``dX = dY . W``    dY, W quantized along N
wgrad    ``dW = dY^T . X``  dY, X quantized along M (tokens)
The bias gradient is the unquantized column sum of dY.

The custom backward is a ``Cell.bprop``: unlike ``mindspore.common._Function`` it also works under
``mindspore.jit`` (the default ``training.jit: true``); the weight and bias are *inputs* of this
cell, not its parameters, so their gradients reach the owning module's Parameters (a Cell with
``bprop`` gives its own Parameters zero gradients).

What is retained for backward: nothing beyond what an unquantized linear keeps. MindSpore hands
``bprop`` the forward inputs ``x`` and ``W`` (it keeps them alive in either case); the forward's
K-blocked copies are dropped as soon as the forward GEMM is done, and the two other blockings
backward needs (``x`` along M, ``W`` along N) are re-quantized from ``x`` and ``W`` in backward.
That costs two extra quantizations and holds no extra activation memory; keeping the M-blocked
``x`` from forward instead would hold a second full-size copy of every linear input until
backward (fp32 here, since CPU emulation has no fp8 storage).
"""
from __future__ import annotations

from typing import Optional

import mindspore as ms
from mindspore import Tensor, nn

from .mx import BLOCK_SIZE, check_scale_mode, elem_format
from . import _dispatch as dispatch


def _fp32(t: Tensor) -> Tensor:
    # Unconditional cast: a ``t.dtype == ...`` test on bprop inputs made jit fail
    # ("The func graph is empty").
    return t.astype(ms.float32)


class _MXBase(nn.Cell):
    def __init__(self, elem_dtype: str = "float8_e4m3fn", scale_mode: str = "floor"):
        super().__init__()
        self.elem_dtype = elem_format(elem_dtype).name
        self.scale_mode = check_scale_mode(scale_mode)


class MXLinearFunction(_MXBase):
    """``construct(x [M, K], w [N, K], b [N])`` with the MX custom backward (see module doc)."""

    def construct(self, x, w, b):
        y = dispatch.gemm_fprop(_fp32(x), _fp32(w), self.elem_dtype, self.scale_mode)
        return (y + _fp32(b)).astype(x.dtype)

    def bprop(self, x, w, b, out, dout):
        dy = _fp32(dout)
        dx = dispatch.gemm_dgrad(dy, _fp32(w), self.elem_dtype, self.scale_mode)
        dw = dispatch.gemm_wgrad(dy, _fp32(x), self.elem_dtype, self.scale_mode)
        return dx.astype(x.dtype), dw.astype(w.dtype), dy.sum(0).astype(b.dtype)


class MXLinearFunctionNoBias(_MXBase):
    """The bias-free variant: ``bprop`` must match ``construct``'s arity, and under
    ``mindspore.jit`` a subclass overriding another custom-bprop Cell fails to compile
    ("The func graph is empty"), hence the common base without a ``bprop``."""

    def construct(self, x, w):
        y = dispatch.gemm_fprop(_fp32(x), _fp32(w), self.elem_dtype, self.scale_mode)
        return y.astype(x.dtype)

    def bprop(self, x, w, out, dout):
        dy = _fp32(dout)
        dx = dispatch.gemm_dgrad(dy, _fp32(w), self.elem_dtype, self.scale_mode)
        dw = dispatch.gemm_wgrad(dy, _fp32(x), self.elem_dtype, self.scale_mode)
        return dx.astype(x.dtype), dw.astype(w.dtype)


def make_function(elem_dtype: str, scale_mode: str, has_bias: bool) -> nn.Cell:
    """The custom-backward cell for one (format, scale mode, bias) combination."""
    dispatch.resolve_mx_path()
    cls = MXLinearFunction if has_bias else MXLinearFunctionNoBias
    return cls(elem_dtype, scale_mode)


_FUNCS: dict = {}


def mx_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
              scale_mode: str = "floor", elem_dtype: str = "float8_e4m3fn") -> Tensor:
    """MXFP8 ``x W^T + b`` for ``x [..., K]``, ``weight [N, K]``; differentiable (module doc).

    K and N must be multiples of 32 (the MX block); the token count M need not be (it is padded
    inside the weight-gradient quantization).
    """
    n, k = weight.shape
    if k % BLOCK_SIZE or n % BLOCK_SIZE:
        raise ValueError(f"mx_linear: weight shape {tuple(weight.shape)} needs both dims to be "
                         f"multiples of {BLOCK_SIZE}")
    if x.shape[-1] != k:
        raise ValueError(f"mx_linear: x has {x.shape[-1]} features, weight expects {k}")
    key = (elem_format(elem_dtype).name, check_scale_mode(scale_mode), bias is not None)
    if key not in _FUNCS:
        _FUNCS[key] = make_function(*key)
    fn = _FUNCS[key]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    y = fn(x2, weight, bias) if bias is not None else fn(x2, weight)
    return y.reshape(*lead, n)
