"""Which GEMM multiplies bf16 operands on CPU (the BLAS kernels' bf16 path; fp32 accumulation).

* oneMKL's ``cblas_gemm_bf16bf16f32`` (PyPI package ``mkl``, the ``ms-llm[cpu-bf16]`` extra) runs
  on the CPU's AVX512-BF16 / AMX-BF16 units: measured 653 GFLOP/s against 272-295 for fp32 sgemm on
  a Xeon with AMX (2 threads, 2048x512 @ 512x1408). Used when the CPU has those units and the
  package is installed.
* Otherwise (no such units, or no ``mkl``): the kernels widen the bf16 operands to fp32 (exact)
  and call OpenBLAS sgemm -- the same numbers (bf16 inputs, fp32 accumulation) up to summation
  order. On an AVX2-only CPU (AMD EPYC Zen 3) MKL's bf16 GEMM ran at 48-60 GFLOP/s against
  67-163 for this path (``benchmarks/bf16.py``), so ``auto`` does not pick it there.

``MS_LLM_BF16_GEMM`` = ``auto`` (default) | ``mkl`` (use MKL whenever it loads, e.g. to test it on
any CPU) | ``openblas`` (never MKL). One line is logged saying which path runs.
"""
from __future__ import annotations

import ctypes
import glob
import logging
import os
import sys
from typing import Optional

from ms_llm.compat.environment import setting

logger = logging.getLogger("ms_llm.ops.cpu_kernels")
_STATE: dict = {"path": None}


def cpu_bf16_units() -> list:
    """The bf16 matrix/vector units this CPU reports (``/proc/cpuinfo`` flags)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return [u for u in ("amx_bf16", "avx512_bf16") if u in flags]
    except OSError:
        pass
    return []


def _mkl_library() -> Optional[str]:
    """``libmkl_rt`` of the pip package ``mkl`` (installed into ``<prefix>/lib``), if present."""
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        hits = sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")))
        if hits:
            return hits[-1]
    return None


def load_mkl_gemm(threads: int):
    """(address of ``cblas_gemm_bf16bf16f32``, library path), or raise RuntimeError saying why not."""
    path = _mkl_library()
    if path is None:
        raise RuntimeError("oneMKL is not installed (pip install 'ms-llm[cpu-bf16]' or mkl)")
    try:
        mkl = ctypes.CDLL(path)
        fn = mkl.cblas_gemm_bf16bf16f32
        mkl.MKL_Set_Num_Threads(ctypes.c_int(int(threads)))
    except (OSError, AttributeError) as e:
        raise RuntimeError(f"cannot use {path}: {e}") from e
    _STATE["mkl"] = mkl   # keep it loaded
    return ctypes.cast(fn, ctypes.c_void_p).value, path


def register_bf16_gemm(lib, threads: int) -> str:
    """Register the chosen bf16 GEMM with the BLAS kernel library ``lib``; returns the path name
    ("mkl" or "openblas") and logs it once."""
    choice = str(setting("runtime.bf16_gemm")).strip().lower() or "auto"
    units = cpu_bf16_units()
    why = ""
    path = "openblas"
    if choice not in ("auto", "mkl", "openblas"):
        why = f"runtime.bf16_gemm {choice!r} is not auto, mkl or openblas"
    elif choice == "openblas":
        why = "runtime.bf16_gemm openblas"
    elif choice == "auto" and not units:
        why = "this CPU has no AVX512-BF16/AMX-BF16 units"
    else:
        try:
            addr, lib_path = load_mkl_gemm(threads)
            lib.MsLlmBlasSetBf16Gemm(ctypes.c_void_p(addr))
            path = "mkl"
            why = f"{lib_path}, CPU units: {', '.join(units) or 'none (emulated)'}"
        except RuntimeError as e:
            why = str(e)
    if path == "openblas":
        lib.MsLlmBlasSetBf16Gemm(ctypes.c_void_p(None))
        logger.info("ms_llm bf16 GEMM: OpenBLAS sgemm on bf16 values widened to fp32 (%s)", why)
    else:
        logger.info("ms_llm bf16 GEMM: oneMKL cblas_gemm_bf16bf16f32 (%s)", why)
    _STATE["path"] = path
    return path


def bf16_gemm_path() -> Optional[str]:
    """"mkl" or "openblas" once the BLAS kernels were loaded, else None."""
    return _STATE["path"]
