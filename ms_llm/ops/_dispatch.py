"""Choose, once per process, which implementation of a hot op runs, and log the choice once.

``resolve_paths()`` makes every choice eagerly (it may compile the C++ kernels); the trainer calls
it before ``mindspore.jit`` traces the model, so graph capture only ever reads a dict.
"""
from __future__ import annotations

import logging

from mindspore.ops import constexpr

from ms_llm.compat import is_ascend, is_cpu
from ms_llm.compat.environment import setting

log = logging.getLogger("ms_llm.ops")
OPS = ("rms_norm", "swiglu", "rope", "attention", "cross_entropy", "linear", "residual_add",
       "embedding", "split_last", "cast")
_PATHS: dict = {}
_NOTICED: set = set()
# Ops with a C++ CPU kernel (attention: its fused scale + causal mask + softmax): every one.
AOT_OPS = OPS


def aot_enabled() -> bool:
    """True when the ahead-of-time C++ CPU kernels (ms_llm.ops.cpu_kernels) can be used."""
    if not is_cpu() or not setting("runtime.aot_kernels"):
        return False
    from . import cpu_kernels  # compiled on first use; False (with a logged reason) on failure
    return bool(cpu_kernels.available())


def blas_enabled() -> bool:
    """True when the OpenBLAS-backed matmul kernels can be used (needs scipy-openblas32)."""
    if not aot_enabled() or not setting("runtime.blas_kernels"):
        return False
    from . import cpu_kernels
    return bool(cpu_kernels.blas_available())


def resolve_paths() -> dict:
    """Each hot op's kernel path on this device (``native``, ``aot`` or ``composed``), chosen
    once per process."""
    if not _PATHS:
        aot = aot_enabled()
        for op in OPS:
            ok = blas_enabled() if op == "linear" else aot and op in AOT_OPS
            _PATHS[op] = "native" if is_ascend() else ("aot" if ok else "composed")
            log.info("ms_llm.ops.%s uses the %s path", op, _PATHS[op])
    return dict(_PATHS)


@constexpr  # evaluated at compile time under mindspore.jit; a plain call in PyNative
def path_for(op: str) -> str:
    """"native" (Ascend fused kernel), "aot" (C++ CPU kernel) or "composed" (mint/ops graph)."""
    if not _PATHS:
        resolve_paths()
    return _PATHS[op]


def fallback_notice(op: str, reason: str) -> None:
    """Log once per process and reason that ``op`` takes its composed form instead of the native
    kernel (the kernel's documented limits exclude this call)."""
    if (op, reason) not in _NOTICED:
        _NOTICED.add((op, reason))
        log.warning("ms_llm.ops.%s: composed path instead of the Ascend kernel (%s)", op, reason)


def native_unless(op: str, reason: str) -> str:
    """``path_for(op)``, but ``composed`` (with one notice) when ``reason`` says why the native
    kernel must not take this call ('' when it may)."""
    path = path_for(op)
    if path == "native" and reason:
        fallback_notice(op, reason)
        return "composed"
    return path
