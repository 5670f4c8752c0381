"""Muon's Newton-Schulz as one CPU op (``blas_muon.cpp``): every step of a batch of same-shape
matrices in one call, the symmetric products as SYRK, optionally with bf16 GEMM operands.

Why: composed in PyNative, each Newton-Schulz step of each matrix was ~8 dispatched ops and
three full GEMMs; the kernel issues the BLAS calls back to back and halves the flops of the
two symmetric products (``X X^T`` and ``A A``), about a quarter of the total for the usual
shapes. fp32 (the default) runs on OpenBLAS; ``bf16=True`` multiplies bf16-rounded operands
with fp32 accumulation through oneDNN's ``dnnl_gemm_bf16bf16f32`` from MindSpore's own
``lib/libdnnl.so.3`` (AVX512-BF16 where the CPU has it), loaded on first use. oneDNN is
MindSpore's threadpool build: its GEMM runs on the calling thread (one per msrun worker).

Callers check :func:`ns_kernel_available` (and :func:`bf16_ns_available` for bf16) and keep the
composed form otherwise.
"""
from __future__ import annotations

import ctypes
import logging
import os
from typing import Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from ..gemm.blas import _cdll
from ..build import blas_available, blas_library_path

logger = logging.getLogger("ms_llm.ops.cpu_kernels")
_STATE: dict = {}


def ns_kernel_available() -> bool:
    """True when the BLAS kernel library (which holds the Newton-Schulz kernel) is built."""
    return ms.get_context("device_target") == "CPU" and blas_available()


def _dnnl_path() -> str:
    return os.path.join(os.path.dirname(ms.__file__), "lib", "libdnnl.so.3")


def bf16_ns_available() -> Tuple[bool, str]:
    """(whether the bf16 Newton-Schulz can run, why not). Registers oneDNN's bf16 GEMM with the
    kernel library on the first call."""
    if "bf16" not in _STATE:
        _STATE["bf16"] = _register_bf16()
    return _STATE["bf16"]


def _register_bf16() -> Tuple[bool, str]:
    if not ns_kernel_available():
        return False, "the BLAS kernel library is not built (see ms_llm.ops.cpu_kernels.build)"
    path = _dnnl_path()
    try:
        dnnl = ctypes.CDLL(path)
        addr = ctypes.cast(dnnl.dnnl_gemm_bf16bf16f32, ctypes.c_void_p).value
    except (OSError, AttributeError) as e:
        return False, f"cannot use oneDNN's dnnl_gemm_bf16bf16f32 from {path}: {e}"
    _STATE["dnnl"] = dnnl                     # keep it loaded
    _cdll().MsLlmMuonSetBf16Gemm(ctypes.c_void_p(addr))
    logger.info("ms_llm Muon bf16 Newton-Schulz: oneDNN dnnl_gemm_bf16bf16f32 (%s)", path)
    return True, ""


def _prim():
    if "prim" not in _STATE:
        _cdll()     # first use: OpenBLAS's thread count (see blas.py)
        _STATE["prim"] = ops.Custom(f"{blas_library_path()}:MuonNewtonSchulz",
                                    out_shape=lambda x, c, f: x, out_dtype=lambda x, c, f: x,
                                    func_type="aot")
    return _STATE["prim"]


def _coefficients(schedule: Sequence[Tuple[float, float, float]]) -> Tensor:
    key = ("coeffs", tuple(map(tuple, schedule)))
    if key not in _STATE:
        _STATE[key] = Tensor(np.asarray(schedule, np.float32).reshape(-1, 3))
    return _STATE[key]


def newton_schulz_kernel(x: Tensor, schedule: Sequence[Tuple[float, float, float]],
                         eps: float, bf16: bool = False) -> Tensor:
    """Newton-Schulz of fp32 ``x`` (``[m, n]`` or a batch ``[..., m, n]``), each matrix
    normalised by its Frobenius norm (at least ``eps``) and iterated on its smaller side with
    the ``(a, b, c)`` steps of ``schedule``. ``bf16``: bf16 GEMM operands (check
    :func:`bf16_ns_available` first)."""
    if not schedule:
        raise ValueError("newton_schulz_kernel: an empty coefficient schedule")
    if bf16:
        ok, why = bf16_ns_available()
        if not ok:
            raise RuntimeError(f"newton_schulz_kernel bf16: {why}")
    key = ("flags", bool(bf16), float(eps))
    if key not in _STATE:
        _STATE[key] = Tensor(np.array([1.0 if bf16 else 0.0, eps], np.float32))
    return _prim()(x.contiguous(), _coefficients(schedule), _STATE[key])

