"""oneDNN's bf16 matmul primitive for the BLAS kernels' bf16 GEMMs (``runtime.bf16_gemm: dnnl``).

MindSpore's wheel ships oneDNN 3 (``<mindspore>/lib/libdnnl.so.3``) without headers. ``dnnl_gemm.cpp``
declares the few C API functions it needs, is compiled on first use into
``libmsllm_dnnl_gemm.so`` (same cache, key, lock and atomic-replace machinery as the other kernel
libraries, :mod:`..build`) and linked against that copy, so a bf16 step needs no extra package.

Why the matmul primitive and not ``dnnl_gemm_bf16bf16f32``: on a 2-core Zen 4 (AVX512-BF16, no AMX)
the plain GEMM entry point reached 276-407 GFLOP/s at n = 512-2048 against 475-734 for torch's bf16
matmul, which uses the primitive (brgemm kernels); ``benchmarks/bf16.py`` puts both side by side.

MindSpore's oneDNN uses the THREADPOOL CPU runtime, so the library brings its own (OpenMP)
threadpool and runs on ``threads`` threads (the BLAS kernels' count). Primitives are cached per
shape inside the library.

    addr = load_dnnl_gemm(threads)   # address with cblas_gemm_bf16bf16f32's signature, or RuntimeError
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

from ..build import _BASE_FLAGS, Library

LIB_NAME = "libmsllm_dnnl_gemm.so"
_SRC = Path(__file__).resolve().parent / "dnnl_gemm.cpp"
_STATE: dict = {"lib": None, "threads": None}


def onednn_library() -> Path:
    """MindSpore's bundled ``libdnnl.so.3``, or RuntimeError saying it is missing."""
    import mindspore
    path = Path(mindspore.__file__).resolve().parent / "lib" / "libdnnl.so.3"
    if not path.is_file():
        raise RuntimeError(f"MindSpore {mindspore.__version__} ships no oneDNN ({path} missing)")
    return path


def onednn_version() -> str:
    """``major.minor.patch`` of MindSpore's oneDNN (RuntimeError when missing)."""

    class _Version(ctypes.Structure):
        _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int),
                    ("hash", ctypes.c_char_p), ("cpu_runtime", ctypes.c_uint),
                    ("gpu_runtime", ctypes.c_uint)]

    lib = ctypes.CDLL(str(onednn_library()))
    lib.dnnl_version.restype = ctypes.POINTER(_Version)
    v = lib.dnnl_version().contents
    return f"{v.major}.{v.minor}.{v.patch}"


def _flag_sets():
    lib = onednn_library()
    return [(_BASE_FLAGS + ["-fopenmp"], [str(lib), f"-Wl,-rpath,{lib.parent}"], "")]


_DNNL = Library("oneDNN bf16 GEMM", LIB_NAME, "MsLlmDnnlAbiVersion", lambda: [_SRC], _flag_sets,
                key_extra=lambda: ("onednn " + onednn_version(),),
                fallback_msg="bf16 GEMMs use another path")


def library() -> ctypes.CDLL:
    """The built library (initialised on ``threads``; see :func:`load_dnnl_gemm`), or RuntimeError."""
    if _STATE["lib"] is None:
        path = _DNNL.path()
        if path is None:
            raise RuntimeError(f"the oneDNN bf16 GEMM library is not built: {_DNNL.state['reason']}")
        lib = ctypes.CDLL(str(path))
        lib.MsLlmDnnlMatmulBf16.argtypes = [ctypes.c_int, ctypes.c_int] + [ctypes.c_int64] * 3 + [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
            ctypes.c_int64, ctypes.c_int]
        lib.MsLlmDnnlCachedPrimitives.restype = ctypes.c_int64
        _STATE["lib"] = lib
    return _STATE["lib"]


def load_dnnl_gemm(threads: int) -> int:
    """Address of ``MsLlmDnnlCblasGemmBf16`` (``cblas_gemm_bf16bf16f32``'s signature) running on
    ``threads`` threads, for ``MsLlmBlasSetBf16Gemm``; RuntimeError saying why not."""
    lib = library()
    if _STATE["threads"] != int(threads):
        rc = lib.MsLlmDnnlInit(int(threads))
        if rc == 1:
            raise RuntimeError(f"MindSpore's oneDNN is {onednn_version()}, the kernel needs 3.x")
        if rc:
            raise RuntimeError("oneDNN engine/stream creation failed")
        _STATE["threads"] = int(threads)
    return ctypes.cast(lib.MsLlmDnnlCblasGemmBf16, ctypes.c_void_p).value


def matmul_address(threads: int) -> int:
    """Address of ``MsLlmDnnlMatmulBf16`` (bf16 or fp32 output), for ``MsLlmBlasSetBf16Matmul``:
    the BLAS kernels then write bf16 outputs straight from the primitive (no fp32 scratch buffer,
    no rounding pass)."""
    load_dnnl_gemm(threads)
    return ctypes.cast(library().MsLlmDnnlMatmulBf16, ctypes.c_void_p).value


def matmul_bf16(a, b, c, trans_a: bool = False, trans_b: bool = False) -> None:
    """``c = op(a) @ op(b)`` on NumPy/torch-style host arrays exposing ``data_ptr()`` or
    ``ctypes.data``: a, b bf16 (uint16 bits or bfloat16), c fp32 or bf16, all C-contiguous 2-D.
    For benchmarks and tests of the primitive itself; raises RuntimeError on a oneDNN failure."""
    lib = library()
    if _STATE["threads"] is None:
        raise RuntimeError("call load_dnnl_gemm(threads) first")

    def ptr(t):
        return t.data_ptr() if hasattr(t, "data_ptr") else t.ctypes.data

    m, k = (a.shape[1], a.shape[0]) if trans_a else tuple(a.shape)
    n = b.shape[0] if trans_b else b.shape[1]
    c_bf16 = str(c.dtype) in ("bfloat16", "torch.bfloat16", "uint16")
    rc = lib.MsLlmDnnlMatmulBf16(int(trans_a), int(trans_b), m, n, k, ptr(a), a.shape[1], ptr(b),
                                 b.shape[1], ptr(c), c.shape[1], int(c_bf16))
    if rc:
        raise RuntimeError(f"oneDNN matmul failed (code {rc}, dnnl status {lib.MsLlmDnnlLastError()})")


def cached_primitives() -> Optional[int]:
    """How many matmul primitives the library holds (None before it is loaded)."""
    return None if _STATE["lib"] is None else int(_STATE["lib"].MsLlmDnnlCachedPrimitives())
