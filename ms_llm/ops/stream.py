"""The activation stream's data movement -- residual add and fork, token embedding, the QKV
split and attention's head layout, bf16 <-> fp32 casts -- with a CPU kernel for the bf16 stream
(the head layout: for fp32 too).

MindSpore 2.10 on CPU adds bf16 tensors ~50x slower than fp32 ones and has no bf16 gather, so a
bf16 run spent ~0.35 s per step (~55M model) in the residual adds, ~0.35 s in widening,
gathering and re-rounding the embedding table, and ~0.3 s summing the zero-padded gradients of
``mint.narrow`` pieces of the QKV projection; autograd summed the residual stream's two
gradients and the casts ran at 4-7 ns per element (``ms-llm train --training.bf16`` 407 -> 858
tokens/s on a 2-core Zen 4 with all of them, see docs/performance.md). fp32 keeps MindSpore's own
ops (fast, and traceable by ``training.jit``); Ascend keeps its native ones.
"""
from __future__ import annotations

from mindspore import Tensor
from mindspore.ops import constexpr

from ms_llm.compat import F, bfloat16, float32, nn
from . import cpu_kernels
from ._dispatch import path_for


@constexpr
def _kernel(op: str, dtype) -> bool:
    return dtype == bfloat16 and path_for(op) == "aot"


def residual_add(x: Tensor, h: Tensor) -> Tensor:
    """``x + h`` (Megatron's residual connection)."""
    if _kernel("residual_add", x.dtype) and h.dtype == x.dtype:
        return cpu_kernels.residual_add(x, h)
    return x + h


def fork(x: Tensor) -> tuple:
    """``(x, x)`` for a tensor used twice (the residual stream feeds its norm and its residual
    add). With bf16 on CPU two copies whose gradients one C op sums in the backward, instead of
    MindSpore's autograd adding them with its bf16 Add (~12 ms per 1M elements)."""
    if _kernel("residual_add", x.dtype):
        return cpu_kernels.fork(x)
    return x, x


def embedding(ids: Tensor, weight: Tensor) -> Tensor:
    """``weight[ids]``; the gradient of a repeated id sums its rows."""
    if _kernel("embedding", weight.dtype):
        return cpu_kernels.embedding(ids, weight)
    return F.embedding(ids, weight)


def cast(x: Tensor, dtype) -> Tensor:
    """``x.astype(dtype)``; between bf16 and fp32 on CPU one C pass (MindSpore's CPU Cast moves
    ~4-7 ns per element), differentiable."""
    if x.dtype != dtype and (_kernel("cast", x.dtype) or _kernel("cast", dtype)):
        return cpu_kernels.cast_float(x, dtype)
    return x if x.dtype == dtype else x.astype(dtype)


@constexpr
def _heads_kernel(dtype) -> bool:
    return dtype in (float32, bfloat16) and path_for("split_last") == "aot"


def split_heads(x: Tensor, pieces) -> tuple:
    """``x`` [b, s, g, W] (per group the pieces' heads side by side, ``W = d * sum(pieces)``,
    e.g. Megatron's fused QKV rows ``[q (r heads) | k | v]``: ``pieces = (r, 1, 1)``) as one
    [b, g * p, s, d] tensor per piece (head ``g * p + h``): the layout attention reads.
    On CPU one copy per head row (fp32 and bf16): the composed split + reshape + swapaxes
    leaves strided views that MindSpore makes contiguous at ~0.5 GB/s (8-9 ms per 4 MB,
    4 of them per layer and step of the ~55M model, forward and backward)."""
    if _heads_kernel(x.dtype) and len(pieces) <= cpu_kernels.model.functional.MAX_HEAD_PIECES:
        return cpu_kernels.split_heads(x, pieces)
    b, s, g = x.shape[0], x.shape[1], x.shape[2]
    d = x.shape[-1] // sum(pieces)
    parts = F.split(x, [p * d for p in pieces], -1)
    return tuple(t.reshape(b, s, g * p, d).swapaxes(1, 2) for t, p in zip(parts, pieces))


def merge_heads(x: Tensor) -> Tensor:
    """Attention output [b, nh, s, d] -> [b, s, nh * d] (the inverse layout change; one copy
    per head row on CPU, see :func:`split_heads`)."""
    b, nh, s, d = x.shape
    if _heads_kernel(x.dtype):
        return cpu_kernels.join_heads((x,), 1).reshape(b, s, nh * d)
    return x.swapaxes(1, 2).reshape(b, s, nh * d)


def split_last(x: Tensor, sections) -> tuple:
    """``F.split(x, sections, -1)``; with bf16 on CPU, contiguous pieces whose gradient is one
    concatenation."""
    if _kernel("split_last", x.dtype):
        return cpu_kernels.split_last(x, sections)
    return F.split(x, list(sections), -1)


class Embedding(nn.Embedding):
    """``nn.Embedding`` (same parameter name and layout) through :func:`embedding`."""

    def forward(self, ids: Tensor) -> Tensor:
        return embedding(ids, self.weight)
