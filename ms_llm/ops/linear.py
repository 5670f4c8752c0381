"""The matmuls of the model: ``linear`` and the attention's batched products.

On CPU MindSpore's fp32 matmul reaches ~90 GFLOP/s in PyNative and 120-210 under jit at this
model's shapes, while OpenBLAS (``scipy-openblas32``, the build numpy uses) holds ~200 GFLOP/s on
all of them; so the CPU path is an AOT kernel around ``cblas_sgemm`` (``ms_llm.ops.cpu_kernels``,
forward and backward), falling back to MindSpore's own matmul when the BLAS library is missing.
"""
from __future__ import annotations

from typing import Optional

from mindspore import Tensor

from ms_llm.compat import F, nn
from . import cpu_kernels
from ._dispatch import path_for


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    if path_for("linear") == "aot":
        return cpu_kernels.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def bmm(a: Tensor, b: Tensor, transpose_b: bool = False, transpose_a: bool = False) -> Tensor:
    """``op(a) @ op(b)`` over identical leading dimensions, op = transpose of the last two axes
    when its flag is set (the BLAS kernel reads the transposed operand in place, no copy)."""
    if path_for("linear") == "aot":
        return cpu_kernels.bmm(a, b, transpose_a, transpose_b)
    return F.matmul(a.swapaxes(-1, -2) if transpose_a else a,
                    b.swapaxes(-1, -2) if transpose_b else b)


class Linear(nn.Linear):
    """``compat.nn.Linear`` (same parameters and names) on the fast matmul path."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)

    def local_matmul(self, in_features: int, out_features: int, has_bias: bool):
        """The ``(x, weight, bias=None) -> y`` a shard of this layer runs (tensor parallel asks
        the module, so replaced modules describe their own shard's kernel)."""
        return linear
