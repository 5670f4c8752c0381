"""The peak TFLOP/s MFU is reported against (``training.peak_tflops``).

Set explicitly, the key wins. Unset (null) on CPU, the peak is *measured* once: a short fp32 GEMM
through the very matmul the model's linears run (``ms_llm.ops.linear``: the OpenBLAS sgemm kernel
when available, else MindSpore's matmul), best of several repetitions, cached in
``$MS_LLM_CACHE/peak_tflops.json`` (default ``~/.cache/ms_llm``; ``$MS_LLM_PEAK_FILE`` names the file itself) keyed by host, CPU model, kernel
path and thread count, so later runs read it. A CPU has no useful datasheet figure (it depends on
clocks, SIMD width and the BLAS build) and torchtitan / Megatron divide by the achievable dense
GEMM rate in the same spirit. Delete the file to re-measure (a probe on a busy machine measures
low, which inflates MFU). On Ascend there is no probe: the key must be set from the datasheet of
the device (TFLOP/s of the dtype trained in).
"""
from __future__ import annotations

import json
import os
import platform
import socket
import time
from pathlib import Path
from typing import Optional

import numpy as np

from ms_llm.compat.environment import variable

PROBE_SHAPE = (2048, 1024, 1024)   # M, K, N: large enough to reach the BLAS plateau, ~20 ms
PROBE_REPS = 12


def cache_path() -> Path:
    """``$MS_LLM_PEAK_FILE``, else ``peak_tflops.json`` in the kernels' cache root."""
    file = variable("MS_LLM_PEAK_FILE")
    if file:
        return Path(file).expanduser()
    root = variable("MS_LLM_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "ms_llm") / \
        "peak_tflops.json"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _probe_key(path: str, threads: int) -> str:
    return f"{socket.gethostname()}|{_cpu_model()}|fp32|{path}|threads={threads}"


def _threads(path: str) -> int:
    if path == "aot":
        from ms_llm.ops import cpu_kernels
        return cpu_kernels.blas_threads()
    return len(os.sched_getaffinity(0))


def measure_cpu_peak(reps: int = PROBE_REPS) -> float:
    """fp32 TFLOP/s of ``ms_llm.ops.linear`` on a ``PROBE_SHAPE`` GEMM, best of ``reps``."""
    from mindspore import Tensor
    from ms_llm.ops.linear import linear
    m, k, n = PROBE_SHAPE
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((m, k), dtype=np.float32))
    w = Tensor(rng.standard_normal((n, k), dtype=np.float32))
    linear(x, w).asnumpy()                         # warm-up (kernel load, thread pool start)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        linear(x, w).asnumpy()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * m * k * n / best / 1e12


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)


def cpu_peak_tflops(say=None) -> float:
    """The cached probe figure for this host / kernel / thread count, measured if missing."""
    from ms_llm.ops import resolve_paths
    path = resolve_paths()["linear"]
    key = _probe_key(path, _threads(path))
    file = cache_path()
    try:
        cache = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cache = {}
    if isinstance(cache.get(key), (int, float)) and cache[key] > 0:
        return float(cache[key])
    peak = measure_cpu_peak()
    cache[key] = peak
    try:
        _write_json(file, cache)
    except OSError as e:                            # read-only home: measure again next time
        if say:
            say(f"could not cache the peak probe in {file}: {e}")
    if say:
        say(f"peak fp32 GEMM probe: {peak:.3f} TFLOP/s ({key}); cached in {file} (delete it "
            f"to re-measure: a busy machine measures low)")
    return peak


def resolve_peak_tflops(configured: Optional[float], device: str, say=None) -> float:
    """``training.peak_tflops`` if set, else the CPU probe; Ascend requires the key."""
    if configured is not None:
        return float(configured)
    if device != "CPU":
        from ms_llm.config import ConfigError
        raise ConfigError(f"training.peak_tflops: required on {device} (the device's datasheet "
                          f"peak TFLOP/s in the training dtype); only CPU peaks are measured")
    return cpu_peak_tflops(say)
