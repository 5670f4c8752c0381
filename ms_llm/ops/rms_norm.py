"""RMSNorm: ``x / sqrt(mean(x^2) + eps) * weight``, computed in fp32."""
from __future__ import annotations

from mindspore import Tensor, ops

from ms_llm.compat import F, float32
from . import cpu_kernels
from ._dispatch import path_for


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    path = path_for("rms_norm")
    if path == "native":  # Ascend fused kernel (ops.rms_norm has no CPU kernel)
        # the API documents gamma of x's dtype (an fp32 parameter, or zero-centred 1 + w, with
        # bf16 activations would not match)
        gamma = weight if weight.dtype == x.dtype else weight.astype(x.dtype)
        return ops.rms_norm(x, gamma, eps)[0]
    if path == "aot":  # fp32 arithmetic; bf16 x and weight are read and written as bf16
        return cpu_kernels.rms_norm(x, weight, eps)
    return rms_norm_composed(x, weight, eps)


def rms_norm_composed(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    dtype = x.dtype
    x32 = x.astype(float32)
    y = x32 * F.rsqrt(F.mean(x32 * x32, -1, keepdim=True) + eps)
    return (y * weight.astype(float32)).astype(dtype)
