"""Choose, once per process, which implementation of a hot op runs, and log the choice once."""
from __future__ import annotations

import logging
import os

from ms_llm.compat import is_ascend, is_cpu

log = logging.getLogger("ms_llm.ops")
_LOGGED: set = set()
_AOT = {"ok": None}


def aot_enabled() -> bool:
    """True when the ahead-of-time C++ CPU kernels (ms_llm.ops.cpu_kernels) can be used."""
    if _AOT["ok"] is None:
        if not is_cpu() or os.environ.get("MS_LLM_DISABLE_AOT", "0") == "1":
            _AOT["ok"] = False
        else:
            from . import cpu_kernels  # built on first use; False when no compiler
            _AOT["ok"] = bool(cpu_kernels.available())
    return _AOT["ok"]


def path_for(op: str) -> str:
    """"native" (Ascend fused kernel), "aot" (C++ CPU kernel) or "composed" (mint/ops graph)."""
    path = "native" if is_ascend() else ("aot" if aot_enabled() else "composed")
    if op not in _LOGGED:
        _LOGGED.add(op)
        log.info("ms_llm.ops.%s uses the %s path", op, path)
    return path
