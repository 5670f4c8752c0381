"""MindSpore ops over the dropless-MoE kernels of ``blas_moe.cpp`` (fp32, CPU, OpenBLAS library).

Why: with many small experts the PyNative MoE layer spent its time dispatching small ops (a split,
two matmuls and a SwiGLU per expert and direction, the sort / inverse / count ops, the combine's
gather-multiply-sum); these ops do the same arithmetic in one call each (see the C++ file).
Callers check :func:`moe_kernels_available` and keep the composed form otherwise.

Every op takes the per-expert block sizes as an int32 *device* tensor, so the step needs no host
copy of the routing counts. Each op has its own backward (``ops.Custom(bprop=...)``); index and
size inputs get zero gradients.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from ..gemm.blas import _ensure_prims
from ..build import blas_available, blas_library_path

_PRIMS: dict = {}


def moe_kernels_available() -> bool:
    """True when the BLAS kernel library (which holds these kernels) is built and loaded."""
    return blas_available() and _ensure_prims()


def _custom(fn, out_shape, out_dtype, bprop=None):
    return ops.Custom(f"{blas_library_path()}:{fn}", out_shape=out_shape, out_dtype=out_dtype,
                      func_type="aot", bprop=bprop)


def _zeros(x):
    return ops.zeros_like(x)


def _sort_prim():
    # The expert count reaches the kernel as the shape of a second input: MindSpore caches a
    # Custom kernel by its input shapes, so an output shape that depends on a Python constant
    # alone would be reused for another expert count.
    if "sort" not in _PRIMS:
        def shape(idx, proto):
            n = 1
            for d in idx:
                n *= d
            return [n], [n], list(proto)

        def bprop(idx, proto, out, dout):
            return _zeros(idx), _zeros(proto)
        _PRIMS["sort"] = _custom("MoeSortByExpert", shape,
                                 lambda idx, proto: (ms.int32, ms.int32, ms.int32), bprop)
    return _PRIMS["sort"]


def _experts_proto(num_experts: int) -> Tensor:
    key = ("proto", num_experts)
    if key not in _PRIMS:
        _PRIMS[key] = Tensor(np.zeros(num_experts, np.int32))
    return _PRIMS[key]


def _permute_prim():
    if "permute" not in _PRIMS:
        bwd = _custom("MoePermuteRowsBwd", lambda d, r, x: x, lambda d, r, x: x)

        def bprop(x, slots, restore, out, dout):
            return bwd(dout, restore, x), _zeros(slots), _zeros(restore)
        _PRIMS["permute"] = _custom("MoePermuteRows", lambda x, s, r: [s[0], x[1]],
                                    lambda x, s, r: x, bprop)
    return _PRIMS["permute"]


def _combine_prim():
    if "combine" not in _PRIMS:
        bwd = _custom("MoeCombineBwd", lambda rows, r, p, d: (rows, p),
                      lambda rows, r, p, d: (rows, p))

        def bprop(rows, restore, probs, out, dout):
            d_rows, d_probs = bwd(rows, restore, probs, dout)
            return d_rows, _zeros(restore), d_probs
        _PRIMS["combine"] = _custom("MoeCombine", lambda rows, r, p: [p[0], rows[1]],
                                    lambda rows, r, p: rows, bprop)
    return _PRIMS["combine"]


def _ffn_prim(nw: int, tb: bool):
    key = ("ffn", nw, tb)
    if key not in _PRIMS:
        def two_f(w1):   # tb: W1 [.., 2F, H]; else [.., H, 2F]
            return w1[-2] if tb else w1[-1]

        bwd = _custom("MoeExpertFfnBwd",
                      lambda x, s, t, h, dy, *ws: (x, *ws),
                      lambda x, s, t, h, dy, *ws: (x, *ws))

        def bprop(*args):
            x, sizes, flag = args[:3]
            ws = args[3:-2]
            out, dout = args[-2], args[-1]
            grads = bwd(x, sizes, flag, out[1], dout[0], *ws)
            return (grads[0], _zeros(sizes), flag * 0, *grads[1:])
        _PRIMS[key] = _custom("MoeExpertFfnFwd",
                              lambda x, s, t, *ws: (x, [x[0], two_f(ws[0])]),
                              lambda x, s, t, *ws: (x, x), bprop)
    return _PRIMS[key]


def sort_by_expert(top_indices: Tensor, num_experts: int) -> Tuple[Tensor, Tensor, Tensor]:
    """``(sorted_slots, restore, tokens_per_expert)`` of ``ms_llm.ops.moe.sort_by_expert``, with
    the counts as an int32 ``[E]`` tensor (no host copy)."""
    return _sort_prim()(ops.stop_gradient(top_indices.astype(ms.int32)),
                        _experts_proto(int(num_experts)))


def permute(tokens: Tensor, sorted_slots: Tensor, restore: Tensor) -> Tensor:
    """``[T, H]`` -> ``[T*k, H]`` rows in expert order; backward sums each token's k rows."""
    return _permute_prim()(tokens, sorted_slots, restore)


def combine(expert_out: Tensor, restore: Tensor, probs: Tensor) -> Tensor:
    """``out[t] = sum_j probs[t, j] * expert_out[restore[t*k + j]]`` (``[T, H]``)."""
    return _combine_prim()(expert_out, restore, probs)


def expert_ffn(x: Tensor, sizes: Tensor, w1: Sequence[Tensor], w2: Sequence[Tensor],
               transpose_b: bool) -> Tensor:
    """SwiGLU expert FFN over the expert-sorted rows ``x`` ``[N, H]`` with int32 block sizes
    ``[E]``: per block ``swiglu(x_e W1_e) W2_e``. ``w1``/``w2``: one stacked ``[E, ...]`` tensor
    each or E per-expert tensors; ``transpose_b``: Linear layout (``W1_e [2F, H]``,
    ``W2_e [H, F]``), else ``W1_e [H, 2F]``, ``W2_e [F, H]``."""
    w1, w2 = list(w1), list(w2)
    if len(w1) != len(w2):
        raise ValueError(f"expert_ffn: {len(w1)} fc1 weights but {len(w2)} fc2 weights")
    prim = _ffn_prim(len(w1), bool(transpose_b))
    return prim(x, sizes, int(bool(transpose_b)), *w1, *w2)[0]
