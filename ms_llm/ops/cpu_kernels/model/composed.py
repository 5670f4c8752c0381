"""Composed MindSpore forms of the fused kernels: the fallback when the AOT kernels are unavailable,
and the baseline in ``benchmarks/ops.py``. All of them run on CPU in PyNative and under ``ms.jit``
(they use only ops that MindSpore 2.10 registers on CPU; many ``mint`` kernels it does not), and
compute in fp32.
"""

from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Tensor, mint, ops
from mindspore.mint.nn import functional as F
from mindspore.ops import constexpr


def _f32(t):
    return t if t.dtype == ms.float32 else t.astype(ms.float32)


def rms_norm(x, weight, eps=1e-6):
    dt = x.dtype
    xf = _f32(x)
    y = xf * mint.rsqrt(mint.mean(xf * xf, -1, keepdim=True) + eps) * _f32(weight)
    return y if dt == ms.float32 else y.astype(dt)


def swiglu(x):
    dt = x.dtype
    a, b = mint.chunk(_f32(x), 2, -1)
    y = F.silu(a) * b
    return y if dt == ms.float32 else y.astype(dt)


def cross_entropy(logits, labels, ignore_index=-100):
    """Per-token loss [N]; 0 where labels == ignore_index. ``ops.log_softmax`` + gather (13x faster
    than ``ops.cross_entropy`` on CPU)."""
    lf = _f32(logits)
    if len(logits.shape) != 2:
        lf = lf.reshape(-1, logits.shape[-1])
    lab = labels.reshape(-1) if len(labels.shape) != 1 else labels
    if lab.dtype != ms.int32:
        lab = lab.astype(ms.int32)
    keep = lab != ignore_index
    safe = mint.where(keep, lab, ops.zeros_like(lab))
    logp = ops.log_softmax(lf, -1)
    picked = mint.gather(logp, 1, safe.reshape(-1, 1)).reshape(-1)
    loss = -picked * keep.astype(ms.float32)
    return loss.reshape(labels.shape) if len(labels.shape) != 1 else loss


def cross_entropy_lse(logits, labels, ignore_index=-100):
    """``(loss [N], logsumexp [N])`` of fp32 logits [N, V] and int labels [N]; 0 where ignored."""
    lab = labels if labels.dtype == ms.int32 else labels.astype(ms.int32)
    keep = lab != ignore_index
    safe = mint.where(keep, lab, ops.zeros_like(lab))
    m = logits.max(axis=-1, keepdims=True)
    lse = (mint.log(mint.sum(mint.exp(logits - m), -1, keepdim=True)) + m).reshape(-1)
    picked = mint.gather(logits, 1, safe.reshape(-1, 1)).reshape(-1)
    keepf = keep.astype(ms.float32)
    return (lse - picked) * keepf, lse * keepf


def cross_entropy_grad(logits, labels, lse, dloss, ignore_index=-100):
    """``(softmax(logits) - onehot(label)) * dloss[:, None]``, rows of ignored labels 0."""
    lab = labels if labels.dtype == ms.int32 else labels.astype(ms.int32)
    keep = lab != ignore_index
    safe = mint.where(keep, lab, ops.zeros_like(lab))
    g = (dloss * keep.astype(ms.float32)).reshape(-1, 1)
    onehot = ops.one_hot(safe, logits.shape[-1], Tensor(1.0, ms.float32), Tensor(0.0, ms.float32))
    return (mint.exp(logits - lse.reshape(-1, 1)) - onehot) * g


def _rotate_half(x):
    x1, x2 = mint.chunk(x, 2, -1)
    return mint.cat([-x2, x1], -1)


@constexpr
def _rope_bshape(shape, seq_dim):
    nd = len(shape)
    sd = seq_dim % nd
    bshape = [1] * nd
    bshape[sd] = shape[sd]
    bshape[-1] = shape[-1]
    return tuple(bshape)


def rope(x, cos, sin, seq_dim=-2):
    """y = x * cos + rotate_half(x) * sin with cos/sin [S, D] broadcast along ``seq_dim`` of x."""
    dt = x.dtype
    xf = _f32(x)
    bshape = _rope_bshape(x.shape, seq_dim)
    c = _f32(cos).reshape(bshape)
    sn = _f32(sin).reshape(bshape)
    y = xf * c + _rotate_half(xf) * sn
    return y if dt == ms.float32 else y.astype(dt)


_MASKS = {}
_F32_MIN = float(np.finfo(np.float32).min)


@constexpr
def _masks(sq, sk):
    """(additive: f32 [Sq, Sk] with 0 / f32-min, keep: f32 [Sq, Sk] 1 / 0) for k <= q + (Sk - Sq)."""
    key = (sq, sk)
    m = _MASKS.get(key)
    if m is None:
        keep = np.tril(np.ones((sq, sk), dtype=np.bool_), k=sk - sq)
        m = (Tensor(np.where(keep, 0.0, _F32_MIN).astype(np.float32)), Tensor(keep.astype(np.float32)))
        _MASKS[key] = m
    return m


def causal_softmax(scores, scale=1.0):
    """softmax(scale * scores + causal additive mask) over the last axis (keys k <= q + Sk - Sq).
    Masked positions come out exactly 0 (exp underflows); rows with no allowed key (only possible when
    Sq > Sk) are zeroed explicitly."""
    dt = scores.dtype
    sq, sk = scores.shape[-2], scores.shape[-1]
    additive, keep = _masks(sq, sk)
    y = mint.softmax(_f32(scores) * scale + additive, -1)
    if sq > sk:
        y = y * keep
    return y if dt == ms.float32 else y.astype(dt)


def embedding(ids, weight):
    """``weight[ids]`` through the shim's gather (fp32 on CPU behind casts)."""
    from ms_llm.compat import F
    return F.embedding(ids, weight)
