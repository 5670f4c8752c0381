"""OCP Microscaling (MX) v1.0 formats, emulated bit-exactly with MindSpore fp32 ops.

MindSpore's CPU backend can neither create nor cast fp8 tensors and has no E8M0 type, so element
codes and scales are kept as uint8 and values are computed in fp32 (bit-exact against ml_dtypes).

Quantization of one block of 32 values ``V`` (along ``axis``):

* ``scale_mode="floor"`` (the OCP spec): ``e = floor(log2(max|V|)) - emax_elem`` (8 for E4M3, 15
  for E5M2), clamped to E8M0's range [-127, 127]. ``floor(log2)`` is exact: MindSpore's ``log2``
  is approximate (it gets e.g. 2^-126 wrong), so its floor is corrected against an exact table of
  powers of two.
* ``scale_mode="rceil"`` (cuBLAS / TransformerEngine): ``e`` = the smallest integer with
  ``2^e * max_elem >= max|V|``. Both element maxima are ``1.75 * 2^emax``, so with
  ``max|V| = m * 2^E`` (``1 <= m < 2``) ``e = E - emax + (max|V| > 1.75 * 2^E)``: an exact
  comparison, no division, no ``log2``.
* Elements: ``V / 2^e`` rounded to nearest-even at the element's precision (subnormals included)
  and saturated to the element's max. An all-zero block gets the smallest scale (2^-127, byte 0);
  a block holding NaN or Inf gets the NaN scale (byte 0xFF) and the element's NaN code.

Denormals: MindSpore's multi-threaded CPU kernels treat fp32-subnormal operands as zero (DAZ) in
some calls and not in others (measured: it depends on the tensor size). ``to_mx`` therefore reads
subnormal inputs from their bits (exact); the jit-able ``fake_quantize`` does so only with
``exact_subnormals=True`` (PyNative). Dequantized values below the smallest fp32 normal (2^-126)
are flushed to signed zero, always, so results never depend on which thread ran a kernel (the
codes themselves are exact; see ``MXTensor.dequantize``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import numpy as np
import mindspore as ms
from mindspore import Tensor, mint, ops

BLOCK_SIZE = 32
SCALE_MODES = ("floor", "rceil")
E8M0_NAN = 0xFF
E8M0_BIAS = 127


@dataclass(frozen=True)
class ElemFormat:
    """An OCP MX element format: bit layout, exponent range and saturation value."""
    name: str
    ebits: int
    mbits: int
    bias: int
    emax: int           # exponent of the largest normal (8 for E4M3, 15 for E5M2)
    max_normal: float   # 448 / 57344
    nan_code: int       # canonical positive NaN code (what ml_dtypes produces)

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal; subnormals are spaced 2^(emin - mbits)."""
        return 1 - self.bias


ELEM_FORMATS = {
    "float8_e4m3fn": ElemFormat("float8_e4m3fn", 4, 3, 7, 8, 448.0, 0x7F),
    "float8_e5m2": ElemFormat("float8_e5m2", 5, 2, 15, 15, 57344.0, 0x7E),
}
_ALIASES = {"e4m3": "float8_e4m3fn", "float8_e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}


def elem_format(elem_dtype: str) -> ElemFormat:
    name = _ALIASES.get(str(elem_dtype).lower(), str(elem_dtype).lower())
    if name not in ELEM_FORMATS:
        raise ValueError(f"elem_dtype: unsupported MX element type {elem_dtype!r} "
                         f"(expected one of {sorted(ELEM_FORMATS)})")
    return ELEM_FORMATS[name]


def check_scale_mode(scale_mode: str) -> str:
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode: expected one of {SCALE_MODES}, got {scale_mode!r}")
    return scale_mode


# ----------------------------------------------------------------------------- helpers
# Plain functions of MindSpore ops: they run in PyNative and parse under mindspore.jit, where
# bit views (``Tensor.view(dtype)``) do not exist ("ViewDtype infer failed: not impl"). So the
# training path is float-only: exponents come from ``log2`` corrected against an exact table of
# powers of two, and rounding uses Veltkamp splitting (RNE to m+1 significant bits, checked
# exhaustively against ml_dtypes on a full binade) and the fixed-grid magic-number trick for the
# element subnormals. Measured on this CPU (4096x4096 fp32): same-shape float mul/add ~5 ms,
# broadcasting binary ops, float division and int32 arithmetic 150-250 ms, so per-element work is
# same-shape float ops; broadcasting and integer work happen on the 32x smaller per-block tensors,
# expanded with ``ops.tile``.
_SUB_LIMIT = 2.0 ** -126            # smallest fp32 normal
_POW2 = Tensor(np.ldexp(np.float32(1.0), np.arange(-127, 128)).astype(np.float32))  # [k + 127]


def _pow2_int(k: Tensor) -> Tensor:
    """Exact fp32 ``2^k`` for an int32 tensor, ``k`` clamped to the normal range [-126, 127]."""
    idx = mint.clamp(k, -126, 127) + 127
    return ops.gather(_POW2, idx.reshape(-1), 0).reshape(k.shape)


def _floor_log2(a: Tensor) -> Tensor:
    """Exact int32 ``floor(log2(a))`` for positive normal fp32 ``a`` (``log2`` is approximate:
    it gets e.g. 2^-126 wrong, so its floor is corrected by one step either way)."""
    e0 = mint.clamp(mint.floor(ops.log2(a)).astype(ms.int32), -126, 127)
    p = _pow2_int(e0)
    return e0 - (p > a).astype(ms.int32) + (p * 2.0 <= a).astype(ms.int32)


def _expand(t: Tensor, block: int) -> Tensor:
    """Per-block ``[pre, nblk, 1, post]`` -> per-element ``[pre, nblk, block, post]``."""
    return ops.tile(t, (1, 1, block, 1))


def _mul_pow2_blocks(v: Tensor, e: Tensor, block: int, nan_blocks: Optional[Tensor] = None
                     ) -> Tensor:
    """``v * 2^e`` per block for ``e`` in [-127, 127], as two exact multiplies by normal powers
    of two (2^-127 itself is subnormal); results below 2^-126 are flushed to signed zero, always,
    instead of whenever a kernel thread happens to run with FTZ/DAZ. Blocks in ``nan_blocks``
    become NaN (through a NaN factor: no per-element select)."""
    hi = mint.floor_divide(e, Tensor(2, ms.int32))
    lo = _pow2_int(e - hi)
    if nan_blocks is not None:
        lo = mint.where(nan_blocks, Tensor(float("nan"), ms.float32), lo)
    out = (v * _expand(lo, block)) * _expand(_pow2_int(hi), block)
    return out * (mint.abs(out) >= _SUB_LIMIT).astype(ms.float32)


# ----------------------------------------------------------------------------- blocking
def _normalize_axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis: {axis} is out of range for a {ndim}-d tensor")
    return axis % ndim


def _to_blocks(x: Tensor, axis: int, block: int) -> Tuple[Tensor, tuple]:
    """View ``x`` as ``[pre, nblk, block, post]`` (zero-padded along ``axis``); no transpose."""
    shape = tuple(x.shape)
    n = shape[axis]
    pre = int(np.prod(shape[:axis], dtype=np.int64))
    post = int(np.prod(shape[axis + 1:], dtype=np.int64))
    nblk = -(-n // block)
    pad = nblk * block - n
    x3 = x.reshape(pre, n, post)
    if pad:
        x3 = mint.cat([x3, mint.zeros((pre, pad, post), dtype=x3.dtype)], 1)
    return x3.reshape(pre, nblk, block, post), (shape, axis, n, pre, post, nblk)


def _from_blocks(xb: Tensor, meta: tuple) -> Tensor:
    shape, axis, n, pre, post, nblk = meta
    x3 = xb.reshape(pre, -1, post)
    if x3.shape[1] != n:
        x3 = mint.narrow(x3, 1, 0, n)
    return x3.reshape(shape)


def _scale_shape(meta: tuple) -> tuple:
    shape, axis, _, _, _, nblk = meta
    return shape[:axis] + (nblk,) + shape[axis + 1:]


# ----------------------------------------------------------------------------- the core
def _quantize_blocks(xb: Tensor, fmt: ElemFormat, scale_mode: str, exact_subnormals: bool):
    """Quantize fp32 blocks ``[pre, nblk, block, post]`` (block axis 2).

    Returns ``(q, sgn, e, bad)``: ``q`` the element magnitudes as fp32 values (exact fp8
    values), ``sgn`` +-1 (+-0 for zeros) per element, ``e`` the int32 shared exponent per block
    (``[pre, nblk, 1, post]``), ``bad`` the per-block NaN/Inf mask.

    ``exact_subnormals`` (PyNative only: it reads bits) computes fp32-subnormal inputs from their
    integer mantissa; without it MindSpore's CPU kernels may treat them as zero (DAZ), which only
    ever matters for blocks whose max is below ~2^-115.
    """
    block = xb.shape[2]
    absx = mint.abs(xb)
    # Per block: max magnitude, and NaN/Inf detection (amax skips NaN on CPU; x * 0 does not).
    amax = mint.amax(absx, dim=2, keepdim=True)
    nonfinite = mint.sum(xb * 0.0, dim=2, keepdim=True)
    bad = nonfinite != nonfinite
    a = mint.where(bad, Tensor(1.0, ms.float32), mint.clamp(amax, min=_SUB_LIMIT))
    big_e = _floor_log2(a)                   # zero/subnormal amax -> -126 -> e clamps to -127
    e = big_e - fmt.emax
    if scale_mode == "rceil":   # amax / max_elem > 2^(E - emax)  <=>  amax > 1.75 * 2^E
        e = e + (a > _pow2_int(big_e) * 1.75).astype(ms.int32)
    e = mint.clamp(e, -127, 127)
    # y = |x| / 2^e by one exact multiply (2^-e is normal: e <= 120 for finite fp32 inputs).
    y = absx * _expand(_pow2_int(0 - e), block)
    if exact_subnormals:
        bits = xb.view(ms.int32)
        is_sub = (absx < _SUB_LIMIT).astype(ms.float32)
        mant = absx.view(ms.int32).astype(ms.float32)          # exact: < 2^23 for subnormals
        y_sub = mant * _expand(_pow2_int(-149 - e), block)     # clamp only overestimates values
        y = mint.maximum(y, y_sub * is_sub)                    # that round to zero anyway
        sgn = 1.0 - 2.0 * (bits.astype(ms.float32) < 0.0).astype(ms.float32)
    else:
        sgn = mint.clamp((xb * 2.0 ** 127) * 2.0 ** 127, -1.0, 1.0)
    # Round to nearest even: Veltkamp splitting keeps m+1 significant bits (element normals);
    # below 2^emin the grid is fixed, (y + M) - M with M = 1.5 * 2^(23 + emin - m).
    g = y * float(2.0 ** (23 - fmt.mbits) + 1.0)
    q_norm = g + (y - g)
    magic = float(1.5 * 2.0 ** (23 + fmt.emin - fmt.mbits))
    q_sub = (y + magic) - magic
    q = mint.where(y < float(2.0 ** fmt.emin), q_sub, q_norm)
    q = mint.clamp(q, max=fmt.max_normal)
    return q, sgn, e, bad


def _encode(q: Tensor, sgn: Tensor, bad: Tensor, fmt: ElemFormat) -> Tensor:
    """fp8 codes (float 0..255) of the exact magnitudes ``q`` (PyNative: reads bits): normals from
    q's fp32 bits (``(bits >> (23 - m)) - ((127 - bias) << m)``, exact in fp32), subnormals as
    ``q / 2^(emin - m)``; ``max`` picks the right one (each is below the other outside its
    range)."""
    m = fmt.mbits
    normal = q.view(ms.int32).astype(ms.float32) * float(2.0 ** (m - 23)) - \
        float((127 - fmt.bias) << m)
    sub = mint.clamp(q * float(2.0 ** (m - fmt.emin)), max=float(1 << m))
    code = mint.maximum(normal, sub) + (sgn < 0.0).astype(ms.float32) * 128.0
    return mint.where(_expand(bad, q.shape[2]), Tensor(float(fmt.nan_code), ms.float32), code)


def _as_fp32_tensor(x) -> Tuple[Tensor, bool]:
    """(fp32 MindSpore tensor, was_numpy). fp16/bf16 upcasts are exact."""
    if isinstance(x, np.ndarray) or np.isscalar(x):
        arr = np.asarray(x)
        if arr.dtype.kind != "f":
            raise TypeError(f"to_mx: expected a floating-point array, got dtype {arr.dtype}")
        if arr.dtype != np.float32:
            arr = arr.astype(np.float32)
        return Tensor(np.ascontiguousarray(arr)), True
    if isinstance(x, Tensor):
        if x.dtype not in (ms.float32, ms.float16, ms.bfloat16):
            raise TypeError(f"to_mx: expected a float32/float16/bfloat16 tensor, got {x.dtype}")
        return (x if x.dtype == ms.float32 else x.astype(ms.float32)), False
    raise TypeError(f"to_mx: expected a numpy array or mindspore Tensor, got {type(x).__name__}")


# ----------------------------------------------------------------------------- public API
@dataclass
class MXTensor:
    """An MX-quantized tensor. ``qdata``: uint8 element codes, same shape as the source;
    ``scale``: uint8 E8M0 codes, the source shape with ``axis`` reduced to ceil(n / block_size).
    Both are numpy arrays when the source was numpy, MindSpore tensors otherwise."""
    qdata: Union[np.ndarray, Tensor]
    scale: Union[np.ndarray, Tensor]
    axis: int
    elem_dtype: str
    block_size: int = BLOCK_SIZE
    scale_mode: str = "floor"

    @property
    def shape(self) -> tuple:
        return tuple(self.qdata.shape)

    def dequantize(self) -> Union[np.ndarray, Tensor]:
        """float32 values ``elem * 2^(scale - 127)``: NaN for NaN-scale blocks, and values below
        2^-126 flushed to signed zero (see the module docstring)."""
        was_np = isinstance(self.qdata, np.ndarray)
        codes = Tensor(self.qdata) if was_np else self.qdata
        scale = Tensor(self.scale) if was_np else self.scale
        fmt = elem_format(self.elem_dtype)
        lut = Tensor(element_values(fmt))
        vals = ops.gather(lut, codes.astype(ms.int32).reshape(-1), 0).reshape(codes.shape)
        vb, meta = _to_blocks(vals, self.axis, self.block_size)
        sb = scale.astype(ms.int32).reshape(meta[3], meta[5], 1, meta[4])
        out = _from_blocks(_mul_pow2_blocks(vb, sb - E8M0_BIAS, self.block_size,
                                            sb == E8M0_NAN), meta)
        return out.asnumpy() if was_np else out


def element_values(fmt: ElemFormat) -> np.ndarray:
    """fp32 value of every code 0..255 of an element format, decoded from the bit layout."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    ef = (codes >> fmt.mbits) & ((1 << fmt.ebits) - 1)
    mf = codes & ((1 << fmt.mbits) - 1)
    mag = np.where(ef == 0, mf * 2.0 ** (fmt.emin - fmt.mbits),
                   (1.0 + mf / 2.0 ** fmt.mbits) * 2.0 ** (ef.astype(np.float64) - fmt.bias))
    if fmt.name == "float8_e4m3fn":   # S.1111.111 is NaN; no infinities
        mag = np.where((ef == 15) & (mf == 7), np.nan, mag)
    else:                             # E5M2 is IEEE-like: exponent 31 = Inf/NaN
        mag = np.where(ef == 31, np.where(mf == 0, np.inf, np.nan), mag)
    return (sign * mag).astype(np.float32)


def to_mx(x, elem_dtype: str = "float8_e4m3fn", block_size: int = BLOCK_SIZE, axis: int = -1,
          scale_mode: str = "floor") -> MXTensor:
    """Quantize ``x`` (numpy array or MindSpore fp32/fp16/bf16 tensor) to MX along ``axis``.

    A length not divisible by ``block_size`` is zero-padded for the computation (padding never
    changes a block's max) and the codes are unpadded on return; the last scale covers the tail.
    """
    fmt = elem_format(elem_dtype)
    check_scale_mode(scale_mode)
    if block_size <= 0:
        raise ValueError(f"block_size: must be > 0, got {block_size}")
    t, was_np = _as_fp32_tensor(x)
    if t.ndim == 0:
        raise ValueError("to_mx: x must have at least one dimension")
    ax = _normalize_axis(axis, t.ndim)
    xb, meta = _to_blocks(t, ax, block_size)
    q, sgn, e, bad = _quantize_blocks(xb, fmt, scale_mode, exact_subnormals=True)
    codes = _from_blocks(_encode(q, sgn, bad, fmt), meta).astype(ms.uint8)
    scale = mint.where(bad, Tensor(E8M0_NAN, ms.int32), e + E8M0_BIAS)
    scale = scale.reshape(_scale_shape(meta)).astype(ms.uint8)
    if was_np:
        codes, scale = codes.asnumpy(), scale.asnumpy()
    return MXTensor(codes, scale, ax, fmt.name, block_size, scale_mode)


def fake_quantize(x: Tensor, axis: int = -1, elem_dtype: str = "float8_e4m3fn",
                  scale_mode: str = "floor", block_size: int = BLOCK_SIZE,
                  exact_subnormals: bool = False) -> Tensor:
    """``to_mx(x, ...).dequantize()`` in one pass, without building codes: the fp32 values an
    MX matmul sees, bit-identical to the two-step form. Used by the emulated MX linear; parses
    under ``mindspore.jit`` (static shapes only). Always returns float32.

    The one exception to bit-identity: fp32-subnormal inputs (|x| < 2^-126) may be read as zero
    by MindSpore's CPU kernels unless ``exact_subnormals=True`` (PyNative only; it reads bits).
    """
    fmt = elem_format(elem_dtype)
    x32 = x.astype(ms.float32)   # unconditional: a dtype test here breaks jit in bprop graphs
    ax = axis % x32.ndim
    xb, meta = _to_blocks(x32, ax, block_size)
    q, sgn, e, bad = _quantize_blocks(xb, fmt, scale_mode, exact_subnormals)
    return _from_blocks(_mul_pow2_blocks(q * sgn, e, block_size, bad), meta)
