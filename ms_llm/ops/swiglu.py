"""SwiGLU on Megatron's fused ``linear_fc1`` output: ``silu(first half) * second half``."""
from __future__ import annotations

from mindspore import Tensor, mint, ops

from ms_llm.compat import F
from . import cpu_kernels
from ._dispatch import path_for


def swiglu(x: Tensor) -> Tensor:
    path = path_for("swiglu")
    if path == "native":  # Ascend fused kernel; ops.swiglu has no CPU kernel
        return ops.swiglu(x, -1)
    if path == "aot":
        return cpu_kernels.swiglu(x)   # fp32 arithmetic; bf16 read and written as bf16
    return swiglu_composed(x)


def swiglu_composed(x: Tensor) -> Tensor:
    gate, up = mint.chunk(x, 2, -1)
    return F.silu(gate) * up
