"""Rotary position embedding, rotate-half convention (Megatron ``apply_rotary_pos_emb``, HF Llama)."""
from __future__ import annotations

from typing import Optional

import numpy as np
import mindspore as ms
from mindspore import Tensor, mint, ops
from mindspore.ops import constexpr

from ms_llm.compat import F, float32
from . import cpu_kernels
from ._dispatch import native_unless


def rope_cos_sin(seq_len: int, dim: int, base: float, position_offset: int = 0,
                 inv_freq: Optional[np.ndarray] = None, attention_factor: float = 1.0):
    """cos, sin of shape [seq_len, dim] (the half-dim frequencies repeated twice), fp32.

    Built in float64 NumPy so angles at long positions keep full precision before the cast.
    ``inv_freq`` ([dim/2]) replaces ``base``'s frequencies (scaled RoPE such as YaRN), and
    ``attention_factor`` multiplies both tables, which is how HF applies YaRN's attention scale.
    """
    if inv_freq is None:
        inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    pos = np.arange(position_offset, position_offset + seq_len, dtype=np.float64)
    freqs = np.outer(pos, np.asarray(inv_freq, dtype=np.float64))
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb) * attention_factor, np.sin(emb) * attention_factor
    return Tensor(cos.astype(np.float32)), Tensor(sin.astype(np.float32))


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [..., s, d]; cos/sin: [s, d] (broadcast over leading dims), or per-sample tables
    that broadcast against x (``[b, 1, s, d]``: packed documents), which take the composed form
    because the fused kernels read one [s, d] table. Tables narrower than ``x`` rotate its first
    ``cos.shape[-1]`` dims and pass the rest through (partial rotary, GLM-4.5)."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        head, tail = F.split(x, [rot, x.shape[-1] - rot], -1)
        return F.cat([_apply_rope_full(head, cos, sin), tail], -1)
    return _apply_rope_full(x, cos, sin)


def _apply_rope_full(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    path = _rope_path(tuple(x.shape), x.dtype) if cos.ndim == 2 else "composed"
    if path == "native":
        # Ascend fused kernel; mode 0 is rotate-half. No CPU kernel (RotaryPositionEmbedding).
        return ops.rotary_position_embedding(x, cos.reshape(1, 1, *cos.shape).astype(x.dtype),
                                             sin.reshape(1, 1, *sin.shape).astype(x.dtype), 0)
    if path == "aot":
        return cpu_kernels.rope(x, cos, sin, -2)
    return apply_rope_composed(x, cos, sin)


@constexpr   # a graph constant under mindspore.jit: the notice is logged at compile time
def _rope_path(shape: tuple, dtype) -> str:
    return native_unless("rope", native_rope_refusal(shape, dtype))


def native_rope_refusal(shape: tuple, dtype) -> str:
    """Why ``ops.rotary_position_embedding`` (rotate-half, x BNSD, cos/sin 11SD) must not take
    ``x`` of this shape, or ''. MindSpore 2.10 documents it as deprecated ("removed after
    2.9.0"), for D even and < 896, B and N < 1000, and as not callable for BNSD when
    B * N > 8 * S with D 32-byte aligned -- every decode step (S = 1) of a batch of 8 heads."""
    if not hasattr(ops, "rotary_position_embedding"):
        return f"mindspore {ms.__version__} has no ops.rotary_position_embedding"
    if len(shape) != 4:
        return f"x is {len(shape)}-D, the kernel takes BNSD"
    b, n, s, d = shape
    if d % 2 or d >= 896 or b >= 1000 or n >= 1000:
        return f"x {list(shape)} outside D even < 896, B and N < 1000"
    if b * n > 8 * s and (d * (4 if dtype == float32 else 2)) % 32 == 0:
        return "BNSD with B*N > 8*S, as in a decode step"
    return ""


def apply_rope_composed(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    dtype = x.dtype
    x = x.astype(float32)
    x1, x2 = mint.chunk(x, 2, -1)
    rotated = F.cat([-x2, x1], -1)
    return (x * cos + rotated * sin).astype(dtype)
