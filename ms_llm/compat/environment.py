"""Every ``MS_LLM_*`` environment variable ms_llm reads, in one place.

Behaviour is set by the run config. The settings below used to be environment variables and
are now schema keys (``ms-llm train --help`` lists them); the old variable is still read as a
deprecated alias when the key is not set explicitly (a one-time logged warning names the
key that replaces it). ``configure`` (called by the trainer from the loaded config, before the device
is set up) hands the explicitly set keys down; the packages below the config (``compat``,
``ops``, ``parallel``, ``quant``) read a setting with :func:`setting`, which is why this module
sits at the bottom, in ``compat``.

======================  ===========================  =======================================
key                     deprecated alias             meaning
======================  ===========================  =======================================
training.device         MS_LLM_DEVICE                auto | CPU | Ascend
runtime.log_level       MS_LLM_LOG_LEVEL             Python log level of ``ms-llm train``
runtime.sync_ops        MS_LLM_SYNC (0 = false)      PyNative ops run synchronously (null: CPU)
runtime.cpu_threads     MS_LLM_CPU_THREADS           MindSpore's CPU kernel thread pool
runtime.comm_thread     MS_LLM_COMM_THREAD (0 = f.)  collectives on a communication thread
runtime.shm_collectives MS_LLM_SHM_COLLECTIVES (0=f) one host's collectives via shared memory
runtime.blas_threads    MS_LLM_BLAS_THREADS          OpenBLAS threads of the BLAS kernels
runtime.bf16_gemm       MS_LLM_BF16_GEMM             auto | dnnl | mkl | openblas
runtime.aot_kernels     MS_LLM_DISABLE_AOT (1 = f.)  the compiled C++ CPU kernels
runtime.blas_kernels    MS_LLM_DISABLE_BLAS (1 = f.) the OpenBLAS-backed matmul kernels
quant.mx_path           MS_LLM_MX_PATH               auto | native | emulated MX matmuls
======================  ===========================  =======================================

Variables that stay variables (``VARIABLES``): test hooks, caches, build tools and the CLI's
default config -- none of them changes what a run computes.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional

log = logging.getLogger("ms_llm.environment")


def _flag(value: str) -> bool:
    return value.strip().lower() not in ("", "0", "false", "no")


@dataclass(frozen=True)
class Setting:
    key: str                          # the run-config key ("section.name")
    alias: str                        # the deprecated environment variable
    default: Any
    from_env: Callable[[str], Any]    # the variable's text -> the key's value


SETTINGS: Dict[str, Setting] = {s.key: s for s in (
    Setting("training.device", "MS_LLM_DEVICE", "auto", str),
    Setting("runtime.log_level", "MS_LLM_LOG_LEVEL", "WARNING", str),
    Setting("runtime.sync_ops", "MS_LLM_SYNC", None, lambda v: v.strip() == "1"),
    Setting("runtime.cpu_threads", "MS_LLM_CPU_THREADS", 1, int),
    Setting("runtime.comm_thread", "MS_LLM_COMM_THREAD", True, lambda v: v.strip() != "0"),
    Setting("runtime.shm_collectives", "MS_LLM_SHM_COLLECTIVES", True,
            lambda v: v.strip() != "0"),
    Setting("runtime.blas_threads", "MS_LLM_BLAS_THREADS", None, str),
    Setting("runtime.bf16_gemm", "MS_LLM_BF16_GEMM", "auto", str),
    Setting("runtime.aot_kernels", "MS_LLM_DISABLE_AOT", True, lambda v: not _flag(v)),
    Setting("runtime.blas_kernels", "MS_LLM_DISABLE_BLAS", True, lambda v: not _flag(v)),
    Setting("quant.mx_path", "MS_LLM_MX_PATH", "auto", str),
)}

# Variables that are not run settings: (name, what it is for).
VARIABLES = {
    "MS_LLM_FAULT_INJECT": "test hook: STEP:RANK SIGKILLs that rank mid-step "
                           "(ms_llm.training.faults)",
    "MS_LLM_NAN_INJECT": "test hook: STEP:PARAM_GLOB turns that gradient NaN "
                         "(ms_llm.training.faults)",
    "MS_LLM_RESTART_ATTEMPT": "set by the restart supervisor: 0 on the first launch, k on "
                              "relaunch k (ms_llm.training.restart)",
    "MS_LLM_CACHE": "cache root of the kernels, the embedded corpus and tokens "
                    "(default ~/.cache/ms_llm)",
    "MS_LLM_PEAK_FILE": "the CPU GEMM peak probe's cache file (ms_llm.planning.peak)",
    "MS_LLM_CXX": "C++ compiler of the CPU kernels (then $CXX, g++)",
    "MS_LLM_AOT_THREADS": "OpenMP threads inside the compiled kernels (read by the .so)",
    "MS_LLM_CONFIG": "the config file ms-llm train uses when none is named",
}

_explicit: Dict[str, Any] = {}
_warned: set = set()


def configure(values: Mapping[str, Any]) -> None:
    """The run's explicitly set setting keys (``{"runtime.comm_thread": False, ...}``); keys
    not given fall back to the deprecated variable, then the default. Replaces the previous
    call's values (a second run in one process does not inherit the first one's)."""
    unknown = [k for k in values if k not in SETTINGS]
    if unknown:
        raise KeyError(f"not a run setting: {', '.join(unknown)}")
    _explicit.clear()
    _explicit.update(values)


def setting(key: str) -> Any:
    """The value of run setting ``key``: set by the config, else its deprecated variable (read
    now: benchmarks flip them between runs), else the default."""
    s = SETTINGS[key]
    if key in _explicit:
        return _explicit[key]
    raw = os.environ.get(s.alias)
    if raw is None or raw.strip() == "":
        return s.default
    if s.alias not in _warned:    # once per process and variable: it is read per call
        _warned.add(s.alias)
        log.warning("%s is deprecated: set %s in the run config (--%s on the command line)",
                    s.alias, key, key)
    try:
        return s.from_env(raw)
    except ValueError:
        raise ValueError(f"{s.alias}={raw!r}: not a valid {key}") from None


def explicit(key: str) -> bool:
    """True when ``key`` was set by the config or by its deprecated variable."""
    return key in _explicit or bool(os.environ.get(SETTINGS[key].alias, "").strip())


def variable(name: str) -> Optional[str]:
    """An ``MS_LLM_*`` variable that stays a variable (``VARIABLES``)."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not one of ms_llm's variables ({', '.join(VARIABLES)})")
    return os.environ.get(name)
