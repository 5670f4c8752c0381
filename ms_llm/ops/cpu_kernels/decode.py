"""Fused one-token decode steps of a transformer layer (``blas_decode.cpp``), PyNative only.

Why: a decode step of a small model is dominated by op dispatch, not arithmetic (each AOT custom
call costs ~100-200 us of MindSpore dispatch on CPU, the layer's matrix-vector products a few
tens). ``attention_block`` runs a layer's whole attention half (norm, QKV, QK-norm, RoPE, the
write of the new K/V into the cache, attention over the filled slots, output gate, projection,
residual) as one call, ``mlp_block`` its SwiGLU MLP half as another.

``cache_attention`` is the attention over a cache alone (one call instead of a matmul / mask /
softmax / matmul chain), for the layers the fused blocks do not cover (MLA, prefill chunks into
a filled cache).

Forward only (no ``bprop``: decoding never differentiates). ``attention_block`` writes into the
cache tensors it is given, in place, a side effect MindSpore's graph compiler cannot see: call it
eagerly (PyNative), never under ``mindspore.jit``.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
from mindspore import Tensor

from .build import blas_available, blas_library_path

_PRIMS: dict = {}


_WANTED = {"on": True}


def available() -> bool:
    """True when the BLAS kernel library (which holds these kernels) is built and loadable and
    :func:`set_enabled` did not turn them off."""
    return _WANTED["on"] and bool(blas_available())


def set_enabled(on: bool) -> bool:
    """Use these kernels (True, the default) or the module / composed paths they replace (the
    reference: tests and ``benchmarks/generate.py`` compare the two); returns the previous one."""
    before = _WANTED["on"]
    _WANTED["on"] = bool(on)
    return before


def _prims() -> dict:
    if not _PRIMS:
        from mindspore import ops
        from .blas import _cdll
        _cdll()   # sets OpenBLAS's thread count on first use, as the other BLAS kernels do
        path = str(blas_library_path())
        _PRIMS["attn"] = ops.Custom(f"{path}:DecodeAttnBlock", out_shape=lambda x, *_: x,
                                    out_dtype=lambda x, *_: x, func_type="aot")
        _PRIMS["mlp"] = ops.Custom(f"{path}:DecodeMlpBlock", out_shape=lambda x, *_: x,
                                   out_dtype=lambda x, *_: x, func_type="aot")
        _PRIMS["cache_attn"] = ops.Custom(
            f"{path}:CacheAttnFwd", out_shape=lambda q, k, v, *_: list(q[:-1]) + [v[-1]],
            out_dtype=lambda q, *_: q, func_type="aot")
    return _PRIMS


_CONST: dict = {}


def _const(values: tuple, dtype) -> Tensor:
    """One Tensor per distinct small constant (the kernels' flags, eps, the slot index)."""
    key = (values, dtype)
    t = _CONST.get(key)
    if t is None:
        if len(_CONST) > 4096:      # slot indices of long runs: keep the cache small
            _CONST.clear()
        t = _CONST[key] = Tensor(np.array(values, dtype))
    return t


def _or_dummy(t: Optional[Tensor]) -> Tensor:
    """An absent optional weight: a one-element tensor the kernel never reads (flagged off)."""
    return _const((0.0,), np.float32) if t is None else t


def cache_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Attention of new queries over a whole cache buffer in one call: q [b, ng, r*s, d] (rows
    ``h*s + i``), k [b, ng, C, d], v [b, ng, C, dv] fp32, mask bool [b or 1, 1, s, C] (True =
    hidden) -> [b, ng, r*s, dv]. Slots past the last visible one are not read; a query that
    sees no slot gets zeros."""
    return _prims()["cache_attn"](q, k, v, mask, _const((float(scale),), np.float32))


class AttentionBlock:
    """The fixed arguments of one layer's ``DecodeAttnBlock`` call (weights, flags), gathered once
    per cache; ``__call__`` adds what changes per token."""

    def __init__(self, norm_w: Tensor, qkv_w: Tensor, qkv_b: Optional[Tensor],
                 q_norm: Optional[Tensor], k_norm: Optional[Tensor], proj_w: Tensor,
                 proj_b: Optional[Tensor], heads_per_group: int, gated: bool,
                 zero_centered: bool, eps: float, scale: float):
        self.prim = _prims()["attn"]
        self.weights = (norm_w, qkv_w, _or_dummy(qkv_b), _or_dummy(q_norm), _or_dummy(k_norm),
                        proj_w, _or_dummy(proj_b))
        self.flags = (0, heads_per_group, int(gated), int(qkv_b is not None),
                      int(q_norm is not None), int(proj_b is not None), int(zero_centered))
        self.fcfg = _const((float(eps), float(scale), 0.0), np.float32)

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                 mask: Tensor, pos: int) -> Tensor:
        """``x + proj(attention(...))`` for one new token per row: x [b, 1, H] fp32; cache
        buffers [b, ng, C, d] (slot ``pos`` is written); mask bool [b or 1, 1, 1, C] (True =
        hidden); cos / sin [1 or b, ..., rot]. See ``blas_decode.cpp`` for the QKV layout."""
        icfg = _const(self.flags + (int(cos.shape[-1]),), np.int64)
        return self.prim(x, *self.weights, cos, sin, k_cache, v_cache, mask, icfg, self.fcfg,
                         _const((int(pos),), np.int64))


class MlpBlock:
    """``x + fc2(swiglu(fc1(rms_norm(x))))``: x [..., H] fp32, fc1 [2F, H] in Megatron's
    ``[gate; up]`` layout, fc2 [H, F]; the fixed arguments gathered once."""

    def __init__(self, norm_w: Tensor, fc1_w: Tensor, fc1_b: Optional[Tensor], fc2_w: Tensor,
                 fc2_b: Optional[Tensor], zero_centered: bool, eps: float):
        self.prim = _prims()["mlp"]
        self.args = (norm_w, fc1_w, _or_dummy(fc1_b), fc2_w, _or_dummy(fc2_b),
                     _const((int(fc1_b is not None), int(fc2_b is not None),
                             int(zero_centered)), np.int64),
                     _const((float(eps),), np.float32))

    def __call__(self, x: Tensor) -> Tensor:
        return self.prim(x, *self.args)
