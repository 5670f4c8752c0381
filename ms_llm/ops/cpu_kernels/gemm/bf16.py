"""Which GEMM multiplies bf16 operands on CPU (the BLAS kernels' bf16 path; fp32 accumulation).

* oneDNN's bf16 matmul primitive (:mod:`.dnnl`, MindSpore's bundled ``libdnnl.so.3``, no extra
  package): brgemm kernels on AVX512-BF16 / AMX-BF16 units, the rate torch's bf16 matmul reaches.
  ``auto``'s first choice on a CPU with those units; ``dnnl`` elsewhere is refused in one line.
* oneMKL's ``cblas_gemm_bf16bf16f32`` (PyPI package ``mkl``, the ``ms-llm[cpu-bf16]`` extra) runs
  on the CPU's AVX512-BF16 / AMX-BF16 units: measured 653 GFLOP/s against 272-295 for fp32 sgemm on
  a Xeon with AMX (2 threads, 2048x512 @ 512x1408). ``auto``'s second choice on such CPUs (when
  oneDNN cannot be used) if the package is installed.
* Otherwise (no such units, or no ``mkl``): the kernels widen the bf16 operands to fp32 (exact)
  and call OpenBLAS sgemm -- the same numbers (bf16 inputs, fp32 accumulation) up to summation
  order. On an AVX2-only CPU (AMD EPYC Zen 3) MKL's bf16 GEMM ran at 48-60 GFLOP/s against
  67-163 for this path (``benchmarks/bf16.py``), so ``auto`` does not pick it there.

``MS_LLM_BF16_GEMM`` = ``auto`` (default) | ``dnnl`` | ``mkl`` (use MKL whenever it loads, e.g. to
test it on any CPU) | ``openblas`` (neither). One line is logged saying which path runs.
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


def _pick(choice: str, units: list, threads: int) -> tuple:
    """(path, address or None, why) for ``runtime.bf16_gemm`` = choice on this CPU."""
    if choice not in ("auto", "dnnl", "mkl", "openblas"):
        return "openblas", None, f"runtime.bf16_gemm {choice!r} is not auto, dnnl, mkl or openblas"
    if choice == "openblas":
        return "openblas", None, "runtime.bf16_gemm openblas"
    if choice == "dnnl" and not units:
        raise RuntimeError("runtime.bf16_gemm dnnl: this CPU has no AVX512-BF16/AMX-BF16 units "
                           "(use auto or openblas)")
    if choice == "auto" and not units:
        return "openblas", None, "this CPU has no AVX512-BF16/AMX-BF16 units"
    errors = []
    if choice in ("auto", "dnnl"):
        from .dnnl import load_dnnl_gemm, onednn_version
        try:
            addr = load_dnnl_gemm(threads)
            return "dnnl", addr, f"oneDNN {onednn_version()} matmul, CPU units: {', '.join(units)}"
        except RuntimeError as e:
            if choice == "dnnl":
                raise RuntimeError(f"runtime.bf16_gemm dnnl: {e}") from e
            errors.append(f"oneDNN: {e}")
    try:
        addr, lib_path = load_mkl_gemm(threads)
        return "mkl", addr, f"{lib_path}, CPU units: {', '.join(units) or 'none (emulated)'}"
    except RuntimeError as e:
        errors.append(str(e))
    return "openblas", None, "; ".join(errors)


def register_bf16_gemm(lib, threads: int) -> str:
    """Register the chosen bf16 GEMM with the BLAS kernel library ``lib``; returns the path name
    ("dnnl", "mkl" or "openblas") and logs it once. ``auto`` on a CPU with bf16 units takes oneDNN's
    matmul primitive (MindSpore's own copy), then oneMKL, then OpenBLAS on widened values;
    ``dnnl`` on a CPU without those units raises RuntimeError (one line)."""
    choice = str(setting("runtime.bf16_gemm")).strip().lower() or "auto"
    path, addr, why = _pick(choice, cpu_bf16_units(), threads)
    lib.MsLlmBlasSetBf16Gemm(ctypes.c_void_p(addr))
    matmul = None
    if path == "dnnl":
        from .dnnl import matmul_address
        matmul = matmul_address(threads)
    lib.MsLlmBlasSetBf16Matmul(ctypes.c_void_p(matmul))
    if path == "openblas":
        logger.info("ms_llm bf16 GEMM: OpenBLAS sgemm on bf16 values widened to fp32 (%s)", why)
    elif path == "dnnl":
        logger.info("ms_llm bf16 GEMM: oneDNN matmul primitive, bf16 x bf16 -> fp32 (%s)", why)
    else:
        logger.info("ms_llm bf16 GEMM: oneMKL cblas_gemm_bf16bf16f32 (%s)", why)
    _STATE["path"] = path
    return path


def bf16_gemm_path() -> Optional[str]:
    """"dnnl", "mkl" or "openblas" once the BLAS kernels were loaded, else None."""
    return _STATE["path"]
