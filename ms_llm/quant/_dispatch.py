"""The one place that decides how MX matmuls run: Ascend-native kernels or emulation.

* ``native``: Ascend 950 ("David" series) with a MindSpore that exposes a dynamic MX quantize op
  (``ops.auto_generate.dynamic_mx_quant``, CANN's ``aclnnDynamicMxQuant``), the E8M0 dtype and
  ``ops.auto_generate.quant_matmul`` (documented as "Only support on David training series").
  **UNTESTED**: no Ascend 950 was available. MindSpore 2.10 lacks ``dynamic_mx_quant`` and
  ``float8_e8m0fnu`` (``missing_mx_ops``; a probe test flips when they appear), so on Ascend
  ``auto`` emulates with one notice naming them and ``native`` is refused in one line; the SoC
  must be an Ascend 950 (``MX_SOCS``).
  ``MS_LLM_MX_PATH=emulated`` forces emulation on any device.
* ``emulated``: every operand is quantized and dequantized bit-exactly to OCP MX v1.0
  (``ms_llm.quant.mx.fake_quantize``) and multiplied in fp32. MindSpore 2.10 on CPU has no fp8
  at all, so this is the only path here.

The choice is made once per process and logged once; ``mx_path`` is a ``constexpr`` so graph
capture under ``mindspore.jit`` reads a constant.
"""
from __future__ import annotations

import logging

import mindspore as ms
from mindspore import Tensor, mint, ops
from mindspore.ops import constexpr

from ms_llm.compat import DeviceUnavailableError, is_ascend
from ms_llm.compat.private_api import ascend_soc_version
from ms_llm.compat.environment import setting
from .mx import fake_quantize

log = logging.getLogger("ms_llm.quant")
_STATE: dict = {}


def missing_mx_ops() -> list:
    """The MindSpore pieces the native MX path needs that the installed MindSpore lacks (2.10:
    ``dynamic_mx_quant`` and ``float8_e8m0fnu``; ``quant_matmul`` exists but takes per-tensor
    or per-channel scales, not per-32-element block scales)."""
    missing = [n for n in ("dynamic_mx_quant", "quant_matmul")
               if not hasattr(ops.auto_generate, n)]
    if not hasattr(ms, "float8_e8m0fnu"):
        missing.append("float8_e8m0fnu")
    return missing


MX_SOCS = ("ascend950",)   # CANN SoC names with MX (E8M0-scaled fp8) matmul units


def _native_support() -> str:
    """'' when the native kernels are usable, else the reason they are not."""
    if not is_ascend():
        return "device is not Ascend"
    missing = missing_mx_ops()
    if missing:
        return f"MindSpore {ms.__version__} lacks {', '.join(missing)}"
    soc = ascend_soc_version()
    if not soc.startswith(MX_SOCS):
        return f"Ascend SoC {soc or 'unknown'} has no MX matmul (Ascend 950 only)"
    return ""


def resolve_mx_path() -> str:
    """Pick and log the MX path once (call before mindspore.jit traces a model)."""
    if "path" not in _STATE:
        forced = str(setting("quant.mx_path")).strip().lower()
        if forced not in ("auto", "native", "emulated"):
            raise ValueError(f"quant.mx_path: expected auto, native or emulated, got {forced!r}")
        reason = _native_support()
        if forced == "native" and reason:
            raise DeviceUnavailableError(f"quant.mx_path native: the native MX kernels are "
                                         f"unusable ({reason}); use auto or emulated")
        path = "emulated" if forced == "emulated" or reason else "native"
        _STATE["path"] = path
        if path == "native":
            log.info("MXFP8 matmuls use the native Ascend kernels (untested in ms-llm's CI)")
        elif forced == "auto" and is_ascend():   # an Ascend user expects native: say why not
            log.warning("quant.mx_path auto: MXFP8 matmuls are emulated in fp32 on Ascend "
                        "(%s)", reason)
        else:
            log.info("MXFP8 matmuls are emulated bit-exactly in fp32 (%s)",
                     "quant.mx_path emulated" if forced == "emulated" else reason)
    return _STATE["path"]


@constexpr
def mx_path() -> str:
    """"native" or "emulated" (compile-time constant under mindspore.jit)."""
    return resolve_mx_path()


# ----------------------------------------------------------------------------- the three GEMMs
# x [M, K], w [N, K], dy [M, N]; fp32 results. Each GEMM quantizes both operands along its
# reduction dimension, as the MX training recipe prescribes.
def gemm_fprop(x: Tensor, w: Tensor, elem_dtype: str, scale_mode: str) -> Tensor:
    """y = x @ w^T, x and w quantized along K."""
    if mx_path() == "native":
        return _native_mm_nt(x, w, elem_dtype, scale_mode)
    return mint.matmul(fake_quantize(x, -1, elem_dtype, scale_mode),
                       fake_quantize(w, -1, elem_dtype, scale_mode).T)


def gemm_dgrad(dy: Tensor, w: Tensor, elem_dtype: str, scale_mode: str) -> Tensor:
    """dx = dy @ w, dy and w quantized along N."""
    if mx_path() == "native":
        return _native_mm_nt(dy, w.T, elem_dtype, scale_mode)
    return mint.matmul(fake_quantize(dy, -1, elem_dtype, scale_mode),
                       fake_quantize(w, 0, elem_dtype, scale_mode))


def gemm_wgrad(dy: Tensor, x: Tensor, elem_dtype: str, scale_mode: str) -> Tensor:
    """dw = dy^T @ x, dy and x quantized along M (tokens)."""
    if mx_path() == "native":
        return _native_mm_nt(dy.T, x.T, elem_dtype, scale_mode)
    return mint.matmul(fake_quantize(dy, 0, elem_dtype, scale_mode).T,
                       fake_quantize(x, 0, elem_dtype, scale_mode))


# ----------------------------------------------------------------------------- native (UNTESTED)
def _native_quant(t: Tensor, elem_dtype: str, scale_mode: str):
    """CANN DynamicMxQuant along the last axis, blocks of 32. scale_alg 0 is the OCP floor rule,
    1 the cuBLAS/TransformerEngine rule (aclnnDynamicMxQuant documentation). UNTESTED."""
    return ops.auto_generate.dynamic_mx_quant(
        t, axis=-1, round_mode="rint", dst_type=getattr(ms, elem_dtype), blocksize=32,
        scale_alg=0 if scale_mode == "floor" else 1)


def _native_mm_nt(a: Tensor, b: Tensor, elem_dtype: str, scale_mode: str) -> Tensor:
    """a [M, K] @ b [N, K]^T on MX operands via quant_matmul (group sizes [1, 1, 32]). UNTESTED."""
    aq, a_scale = _native_quant(a, elem_dtype, scale_mode)      # [M, K], [M, K/32]
    bq, b_scale = _native_quant(b, elem_dtype, scale_mode)      # [N, K], [N, K/32]
    # x2 is [K, N]: its block scales transpose with it ([K/32, N])
    return ops.auto_generate.quant_matmul(
        aq, bq.T, b_scale.T, pertoken_scale=a_scale, output_dtype=ms.float32,
        scale_dtype=ms.float8_e8m0fnu, pertoken_scale_dtype=ms.float8_e8m0fnu,
        group_sizes=(1, 1, 32))
