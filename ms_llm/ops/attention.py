"""Causal softmax attention with grouped-query heads."""
from __future__ import annotations

import functools
import math
from typing import Optional

import numpy as np
from mindspore import Tensor, ops
from mindspore.ops import constexpr
from mindspore import bool_

from ms_llm.compat import F, bfloat16, float16, float32
from . import cpu_kernels
from ._dispatch import blas_enabled, native_unless, path_for
from .linear import bmm
from .stream import cast

_MASK_VALUE = -1e30  # finite so fully-masked rows give a uniform softmax, not NaN


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None,
                     attention_mask: Optional[Tensor] = None) -> Tensor:
    """q: [b, nh, s, d]; k, v: [b, ng, sk, d] with nh % ng == 0 (query head h reads kv head
    h // (nh/ng)). ``attention_mask``: optional bool [b or 1, 1, s, sk], True = masked out
    (Megatron's convention), used instead of the causal mask. Returns [b, nh, s, d].

    ``sk > s`` (queries continuing a KV cache) needs ``attention_mask``, or takes the composed
    form with the causal mask aligned to the last query (query i sees keys ``<= sk - s + i``)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    square = q.shape[2] == k.shape[2]
    path = _native_or_composed(q)
    if path == "native" and (square or attention_mask is not None):
        return _flash_attention_ascend(q, k, v, scale, attention_mask)
    if path == "aot" and attention_mask is None and square:
        return _causal_attention_aot(q, k, v, scale)
    return causal_attention_composed(q, k, v, scale, attention_mask)


def flash_attention_refusal(head_dim: int, dtype) -> str:
    """Why ``ops.flash_attention_score`` must not take this call, or ''. MindSpore 2.10 documents
    head_dim (D) a multiple of 16 and at most 512, and only fp16/bf16 q/k/v: an fp32 model would
    silently run its attention in bf16, so it takes the composed (fp32) form instead."""
    if head_dim % 16 or head_dim > 512:
        return f"head_dim {head_dim} is not a multiple of 16 up to 512"
    if dtype not in _FLASH_DTYPES:
        return f"{dtype} q/k/v (the kernel computes in fp16/bf16 only)"
    return ""


def _native_or_composed(q: Tensor) -> str:
    """The dispatch table's attention path, with the flash kernel's limits checked."""
    return _attention_path(q.shape[-1], q.dtype)


@constexpr   # a graph constant under mindspore.jit: the notice is logged at compile time
def _attention_path(head_dim: int, dtype) -> str:
    return native_unless("attention", flash_attention_refusal(head_dim, dtype))


def pair_kernel_enabled() -> bool:
    """True when one (query chunk, key block) pair of blockwise attention (context parallel)
    runs as one C++ kernel (``cpu_kernels.pair_attention``): CPU with the BLAS kernels on."""
    return path_for("attention") == "aot" and blas_enabled()


def _causal_attention_aot(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    # The grouped layout of the composed form, one C++ kernel (forward and backward): query blocks
    # multiply only the keys the causal mask lets them see (about half the GEMM work of the
    # masked full product) instead of a broadcast add over [b, nh, s, s] and a softmax.
    b, nh, s, d = q.shape
    ng = k.shape[1]
    dtype = q.dtype
    q = cast(q, float32).reshape(b, ng, (nh // ng) * s, d)
    out = cpu_kernels.causal_attention(q, cast(k, float32), cast(v, float32), scale)
    return cast(out.reshape(b, nh, s, d), dtype)


def _causal_mask(s: int, sk: int) -> Tensor:
    return Tensor(np.triu(np.full((s, sk), _MASK_VALUE, np.float32), 1 + sk - s))


def causal_attention_composed(q: Tensor, k: Tensor, v: Tensor, scale: float,
                              attention_mask: Optional[Tensor] = None) -> Tensor:
    # Grouped form: fold the query heads of one KV group into the row dimension, so K and V are
    # never expanded (no repeat_interleave copy of K/V, one batched matmul per group).
    b, nh, s, d = q.shape
    ng, sk = k.shape[1], k.shape[2]
    r = nh // ng
    dtype = q.dtype
    q = q.astype(float32).reshape(b, ng, r * s, d)
    k, v = k.astype(float32), v.astype(float32)
    scores = F.matmul(q, k.swapaxes(-1, -2)).reshape(b, ng, r, s, sk) * scale
    if attention_mask is None:
        if s > 1:   # one query (a decode step) is the last position: it sees every key
            scores = scores + _causal_mask(s, sk)
    else:
        bias = F.where(attention_mask, Tensor(_MASK_VALUE, float32), Tensor(0.0, float32))
        scores = scores + bias.reshape(bias.shape[0], 1, 1, s, sk)
    probs = F.softmax(scores, -1).reshape(b, ng, r * s, sk)
    out = F.matmul(probs, v).reshape(b, nh, s, d)
    return out.astype(dtype)


def cache_attention(q: Tensor, k: Tensor, v: Tensor, attention_mask: Tensor,
                    scale: Optional[float] = None) -> Tensor:
    """Attention of ``s`` new queries over a whole preallocated KV cache buffer.

    q: [b, nh, s, d]; k, v: [b, ng, S, d] (every slot of the buffer); ``attention_mask``: bool
    [b or 1, 1, s, S], True = masked (causal, unfilled and padding slots). Returns [b, nh, s, d].

    Why the whole buffer and not its filled prefix: a prefix is a strided view, and MindSpore
    2.10 makes views contiguous at ~0.2 GB/s on CPU (2.5 ms per layer and per step for 2048
    cached positions of one KV head pair), while the BLAS batched matmul reads the contiguous
    buffer directly; masked slots get zero probability, so the result is attention over the
    filled part. On CPU with the BLAS kernels (fp32, bool mask) it is one C++ call
    (``cpu_kernels.decode.steps.cache_attention``) instead of the matmul / mask / softmax / matmul
    chain; a query that sees no slot then gets zeros rather than the chain's uniform average."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if _native_or_composed(q) == "native":
        return _flash_attention_ascend(q, k, v, scale, attention_mask)
    b, nh, s, d = q.shape
    ng, sk = k.shape[1], k.shape[2]
    r = nh // ng
    dtype = q.dtype
    if attention_mask.dtype == bool_ and _decode_kernel(q.dtype, k.dtype, v.dtype):
        # CPU: one C++ call that reads only the slots up to the last visible one
        from .cpu_kernels.decode import steps as decode
        out = decode.cache_attention(q.reshape(b, ng, r * s, d), k, v, attention_mask, scale)
        return out.reshape(b, nh, s, v.shape[-1])
    q = q.astype(float32).reshape(b, ng, r * s, d)
    scores = bmm(q, k.astype(float32), transpose_b=True).reshape(b, ng, r, s, sk) * scale
    bias = F.where(attention_mask, Tensor(_MASK_VALUE, float32), Tensor(0.0, float32))
    scores = scores + bias.reshape(bias.shape[0], 1, 1, s, sk)
    probs = F.softmax(scores, -1).reshape(b, ng, r * s, sk)
    return bmm(probs, v.astype(float32)).reshape(b, nh, s, d).astype(dtype)


def _decode_kernel(*dtypes) -> bool:
    """The BLAS library's cache attention kernel takes fp32 on CPU with the BLAS kernels."""
    if path_for("linear") != "aot" or any(d != float32 for d in dtypes):
        return False
    from .cpu_kernels.decode import steps as decode
    return decode.available()


# Never run on an Ascend device: written against MindSpore 2.10's documented contract of
# ops.flash_attention_score and reached only when the device is Ascend (CPU tests cover the
# dtype round trip through _flash_attention_dtype, not the kernel).
_FLASH_DTYPES = (bfloat16, float16)


def _flash_attention_dtype(dtype) -> object:
    """The dtype FlashAttentionScore computes in: it accepts only fp16 and bf16 q/k/v, so fp32
    inputs go through bf16 (fp32's exponent range, no overflow of large scores)."""
    return dtype if dtype in _FLASH_DTYPES else bfloat16


@functools.lru_cache(maxsize=1)
def _compressed_causal_mask() -> Tensor:
    # sparse_mode 2 reads this fixed 2048x2048 upper-triangular mask whatever the sequence length.
    return Tensor(np.triu(np.ones((2048, 2048), np.bool_), 1))


def _flash_attention_ascend(q, k, v, scale, attention_mask):
    # Ascend FlashAttentionScore, BNSD layout, GQA handled by the kernel (N1 % N2 == 0).
    # sparse_mode 2 = causal with the compressed 2048x2048 mask the kernel requires.
    if attention_mask is None:
        mask, sparse_mode = _compressed_causal_mask(), 2
    else:
        mask, sparse_mode = attention_mask, 0
        if mask.shape[0] == 1:   # one mask for the whole batch: the kernel's (S1, S2) form
            mask = mask.reshape(mask.shape[-2], mask.shape[-1])
    dtype = q.dtype
    compute = _flash_attention_dtype(dtype)
    out = ops.flash_attention_score(q.astype(compute), k.astype(compute), v.astype(compute),
                                    q.shape[1], attn_mask=mask, scalar_value=scale,
                                    input_layout="BNSD", sparse_mode=sparse_mode)
    return out.astype(dtype)
