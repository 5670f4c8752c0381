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

from ..build import blas_available, blas_library_path

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
        from ..gemm.blas import _cdll
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


# Seconds every ModelStep call adds to (for benchmarks/generate.py's breakdown; reset it there):
# the attention halves without their attention over the cache, that attention, the MLP halves,
# the final norm + LM head + argmax.
STEP_SECONDS = np.zeros(4, np.float64)
STEP_PARTS = ("layer attention halves (norms, QKV, RoPE, proj)", "attention over the cache",
              "layer MLP halves", "final norm + LM head + argmax")


class ModelStep:
    """The whole model's one-token decode step as one C call (``DecodeModelStep`` in
    ``blas_decode_model.cpp``, through ctypes: MindSpore dispatches nothing): token ids in, the
    next greedy tokens (and the logits) out, every layer's K/V written into the cache buffers.

    Built once per generation from fp32 host tensors (``ms_llm.models.fused_decode.model_step``
    checks what the model holds); the tensors are kept referenced here, so their addresses stay
    valid. ``layers``: per layer the 12 weights (input norm, qkv W, qkv bias, q norm, k norm,
    proj W, proj bias, pre-MLP norm, fc1 W, fc1 bias, fc2 W, fc2 bias; None = absent)."""

    _LAYER_PTRS = 14

    def __init__(self, layers: list, embedding: Tensor, final_norm: Tensor, head: Tensor,
                 rope_table, dims: dict, eps: float, scale: float, threads: int,
                 parallel_macs: int = 0):
        import ctypes
        from ..gemm.blas import _cdll
        self._fn = _cdll().DecodeModelStep
        self._fn.restype = ctypes.c_int
        self._keep = (layers, embedding, final_norm, head)
        self.rope_table = rope_table          # rows -> (cos, sin) NumPy [>= rows, rot]
        self.dims = dims
        n = len(layers)
        self.layer_ptrs = np.zeros((n, self._LAYER_PTRS), np.uint64)
        for i, ws in enumerate(layers):
            self.layer_ptrs[i, :12] = [0 if w is None else w.data_ptr() for w in ws]
        self.model_ptrs = np.array([embedding.data_ptr(), final_norm.data_ptr(), head.data_ptr(),
                                    0, 0], np.uint64)
        self.vocab = int(head.shape[0])
        self.cfg = np.zeros(17, np.int64)
        d = dims
        self.cfg[[0, 2, 3, 5, 6, 7, 8, 9, 11, 12, 15]] = [
            n, d["hidden"], self.vocab, d["r"], d["g"], d["d"], d["ffn"], d["rot"],
            int(d["gated"]), int(d["zero_centered"]), max(1, int(threads))]
        self.cfg[16] = int(parallel_macs)     # 0: the kernel's threshold (tests force threads)
        self.fcfg = np.array([eps, scale], np.float32)
        self.logits = None
        self._cache_ids: tuple = ()
        self._table_rows = 0

    def __call__(self, caches: list, ids: np.ndarray, positions: np.ndarray,
                 padding: np.ndarray, pos: int, argmax_vocab: int):
        """One step at slot ``pos`` for ids ``[b]`` at RoPE ``positions`` ``[b]``; ``padding``
        ``[b, >pos]`` bool (True = never attended); ``caches``: the layers' ``(k, v)`` buffers
        ``[b, g, C, d]``. Returns ``(logits [b, V], tokens [b] or None)``: ``argmax_vocab`` > 0
        also picks the first maximum among the first that many logits."""
        import ctypes
        b = ids.shape[0]
        if self.logits is None or self.logits.shape[0] != b:
            self.logits = np.empty((b, self.vocab), np.float32)
            self.tokens = np.empty(b, np.int64)
        key = tuple(id(t) for kv in caches for t in kv)
        if key != self._cache_ids:          # allocated or grown since the last step
            for i, (k, v) in enumerate(caches):
                self.layer_ptrs[i, 12:] = (k.data_ptr(), v.data_ptr())
            self._cache_ids, self._keep_caches = key, caches
            self.cfg[10] = caches[0][0].shape[2]
        need = int(positions.max()) + 1
        if need > self._table_rows:
            cos, sin = self.rope_table(need)
            self._table = (np.ascontiguousarray(cos, np.float32),
                           np.ascontiguousarray(sin, np.float32))
            self._table_rows = cos.shape[0]
            self.model_ptrs[3:] = (self._table[0].ctypes.data, self._table[1].ctypes.data)
        padding = np.ascontiguousarray(padding, dtype=bool)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        cfg = self.cfg
        cfg[1], cfg[4], cfg[13], cfg[14] = b, argmax_vocab, pos, padding.shape[1]
        ptr = ctypes.c_void_p
        rc = self._fn(ptr(self.cfg.ctypes.data), ptr(self.fcfg.ctypes.data),
                      ptr(self.layer_ptrs.ctypes.data), ptr(self.model_ptrs.ctypes.data),
                      ptr(ids.ctypes.data), ptr(positions.ctypes.data), ptr(padding.ctypes.data),
                      ptr(self.logits.ctypes.data), ptr(self.tokens.ctypes.data),
                      ptr(STEP_SECONDS.ctypes.data))
        if rc:
            raise ValueError(f"DecodeModelStep rejected its input (code {rc}): slot {pos}, "
                             f"ids {ids.tolist()}, cache {self.cfg[10]} slots")
        return self.logits, (self.tokens.copy() if argmax_vocab else None)
