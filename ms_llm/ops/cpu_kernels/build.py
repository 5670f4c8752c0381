"""Build the ahead-of-time C++ CPU kernels on first use, into a per-user cache.

The C++ sources ship inside the package (``ms_llm/ops/cpu_kernels/*.cpp``); nothing is prebuilt.
The first call to :func:`library_path` or :func:`available` compiles them with

    g++ -O3 -march=native -fopenmp -shared -fPIC -std=c++17

into ``$MS_LLM_CACHE/kernels/<key>/libmsllm_cpu_kernels.so`` (``~/.cache/ms_llm/kernels/<key>/`` when
``MS_LLM_CACHE`` is unset), where ``<key>`` hashes the sources, the compiler command and version,
the MindSpore version and the CPU identity (``-march=native`` code must not be shared between
different CPUs through a network home directory).

Concurrency: several processes (e.g. ``msrun`` workers) may build at once. The build holds an
exclusive ``fcntl`` lock on ``<key>/.lock``, compiles to a temporary name and ``os.replace``s it,
so a reader never sees a half-written library and the compiler runs once.

Environment:
    MS_LLM_DISABLE_AOT=1   never build or use the kernels (``available()`` is False)
    MS_LLM_CACHE           cache root (default ``~/.cache/ms_llm``)
    MS_LLM_CXX / CXX       compiler (default ``g++``)
    MS_LLM_AOT_THREADS     threads inside the kernels (read by the .so; default min(2, cpus))
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger("ms_llm.ops.cpu_kernels")

LIB_NAME = "libmsllm_cpu_kernels.so"
_SRC_DIR = Path(__file__).resolve().parent
_BASE_FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden"]
_OPENMP_FLAG = "-fopenmp"
_COMPILE_TIMEOUT_S = 300

_lock = threading.Lock()
_state: dict = {"done": False, "path": None, "reason": None}


def sources() -> list[Path]:
    """The C++ sources compiled into the library (every ``*.cpp``/``*.h`` next to this file)."""
    return sorted(list(_SRC_DIR.glob("*.cpp")) + list(_SRC_DIR.glob("*.h")))


def _compiler() -> str | None:
    cxx = os.environ.get("MS_LLM_CXX") or os.environ.get("CXX") or "g++"
    return shutil.which(cxx)


def _compiler_version(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:  # pragma: no cover - depends on the host
        return f"unknown ({e})"


def _cpu_identity() -> str:
    """Model name and feature flags of this CPU (what -march=native depends on)."""
    ident = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            keep = {}
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key in ("model name", "flags", "Features", "CPU part") and key not in keep:
                    keep[key] = " ".join(sorted(val.split()))
                if not line.strip() and keep:
                    break
        ident += "|" + "|".join(f"{k}={v}" for k, v in sorted(keep.items()))
    except OSError:
        pass
    return ident


def _mindspore_version() -> str:
    try:
        import mindspore

        return str(mindspore.__version__)
    except Exception:  # pragma: no cover
        return "none"


def cache_root() -> Path:
    root = os.environ.get("MS_LLM_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "ms_llm"
    return base / "kernels"


def build_key(cxx: str, flags: list[str]) -> str:
    h = hashlib.sha256()
    for src in sources():
        h.update(src.name.encode())
        h.update(src.read_bytes())
    for part in (cxx, " ".join(flags), _compiler_version(cxx), _mindspore_version(), _cpu_identity()):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:20]


def _run(cmd: list[str], cwd: Path) -> tuple[bool, str]:
    try:
        proc = subprocess.run(cmd, cwd=str(cwd), capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"{type(e).__name__}: {e}"
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def _check_library(path: Path) -> str | None:
    """Load the library once with ctypes; returns an error string or None."""
    try:
        lib = ctypes.CDLL(str(path))
        if lib.MsLlmKernelsAbiVersion() != 1:
            return "ABI version mismatch"
    except (OSError, AttributeError) as e:
        return f"cannot load {path}: {e}"
    return None


def _compile(cxx: str, out_dir: Path) -> Path:
    """Compile into out_dir (caller holds the lock). Tries with OpenMP first, then without (libgomp
    missing): -fopenmp-simd keeps the vectorised loops, only the optional threading is lost."""
    target = out_dir / LIB_NAME
    srcs = [str(s) for s in sources() if s.suffix == ".cpp"]
    errors = []
    for flags in (_BASE_FLAGS + [_OPENMP_FLAG], _BASE_FLAGS + ["-fopenmp-simd"]):
        tmp = out_dir / f".{LIB_NAME}.{os.getpid()}.{threading.get_ident()}.tmp"
        ok, log = _run([cxx, *flags, "-o", str(tmp), *srcs], out_dir)
        if ok:
            err = _check_library(tmp)
            if err is None:
                os.replace(tmp, target)
                if _OPENMP_FLAG not in flags:
                    logger.warning("ms_llm AOT kernels: built without OpenMP (single-threaded): %s", errors[-1])
                return target
            log = err
        tmp.unlink(missing_ok=True)
        errors.append(f"{' '.join([cxx, *flags])}: {log[-2000:]}")
    raise RuntimeError("compilation failed:\n" + "\n".join(errors))


def _build() -> Path:
    if platform.system() != "Linux":
        raise RuntimeError(f"AOT custom ops need Linux, this is {platform.system()}")
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (looked for $MS_LLM_CXX, $CXX, g++)")
    key = build_key(cxx, _BASE_FLAGS + [_OPENMP_FLAG])
    out_dir = cache_root() / key
    target = out_dir / LIB_NAME
    if target.exists() and _check_library(target) is None:
        return target
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # read-only home: build in a per-user temp dir instead
        fallback = Path(tempfile.gettempdir()) / f"ms_llm-{os.getuid()}" / "kernels" / key
        logger.warning("ms_llm AOT kernels: cannot create %s (%s), using %s", out_dir, e, fallback)
        out_dir, target = fallback, fallback / LIB_NAME
        out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            if target.exists() and _check_library(target) is None:  # built by another process meanwhile
                return target
            logger.info("ms_llm AOT kernels: compiling %s -> %s", [s.name for s in sources()], target)
            return _compile(cxx, out_dir)
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _disabled() -> bool:
    return os.environ.get("MS_LLM_DISABLE_AOT", "").strip().lower() not in ("", "0", "false", "no")


def library_path() -> Path | None:
    """Path of the built library, building it if needed; None when unavailable (see :func:`reason`)."""
    with _lock:
        if not _state["done"]:
            if _disabled():
                _state["reason"] = "disabled by MS_LLM_DISABLE_AOT"
            else:
                try:
                    _state["path"] = _build()
                except Exception as e:  # noqa: BLE001 - any failure means "use the composed path"
                    _state["reason"] = str(e)
            _state["done"] = True
            if _state["path"] is not None:
                logger.info("ms_llm AOT CPU kernels in use: %s", _state["path"])
            else:
                logger.warning(
                    "ms_llm AOT CPU kernels unavailable, using composed MindSpore ops: %s", _state["reason"]
                )
        return _state["path"]


def available() -> bool:
    """True when the AOT kernels are built and loadable. Logs the reason once when they are not."""
    if _disabled():  # honoured even after a successful build in this process
        if _state["reason"] is None:
            _state["reason"] = "disabled by MS_LLM_DISABLE_AOT"
            logger.warning("ms_llm AOT CPU kernels disabled by MS_LLM_DISABLE_AOT, using composed ops")
        return False
    return library_path() is not None


def reason() -> str | None:
    """Why the kernels are unavailable (None if available or not yet probed)."""
    return _state["reason"]


def _reset_for_tests() -> None:
    with _lock:
        _state.update(done=False, path=None, reason=None)
