"""Build the ahead-of-time C++ CPU kernels on first use, into a per-user cache.

The C++ sources ship inside the package (``ms_llm/ops/cpu_kernels/<domain>/*.cpp``: ``model``,
``optimizer``, ``decode``, ``gemm``; the headers they share here); nothing is prebuilt.
The first call to :func:`library_path` or :func:`available` compiles them with

    g++ -O3 -march=native -fopenmp -shared -fPIC -std=c++17

into ``$MS_LLM_CACHE/kernels/<key>/libmsllm_cpu_kernels.so`` (``~/.cache/ms_llm/kernels/<key>/`` when
``MS_LLM_CACHE`` is unset), where ``<key>`` hashes the sources, the compiler command and version,
the MindSpore version and the CPU identity (``-march=native`` code must not be shared between
different CPUs through a network home directory).

Concurrency: several processes (e.g. ``msrun`` workers) may build at once. The build holds an
exclusive ``fcntl`` lock on ``<key>/.lock``, compiles to a temporary name and ``os.replace``s it,
so a reader never sees a half-written library and the compiler runs once.

A second, separate library holds the kernels that call BLAS (``blas_*.cpp`` ->
``libmsllm_blas_kernels.so``, see :func:`blas_library_path`): it links the OpenBLAS of the PyPI
package ``scipy-openblas32`` (``-L<libdir> -lscipy_openblas -Wl,-rpath,<libdir>``), so when that
package is missing only the BLAS kernels are unavailable (``blas_available()`` False, reason logged)
and the library above is unaffected. Both go through the same :class:`Library` machinery (key,
lock, atomic replace, load check); the BLAS key also hashes the OpenBLAS version and location.

Environment:
    MS_LLM_DISABLE_AOT=1   never build or use the kernels, BLAS ones included (``available()`` is False)
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

from ms_llm.compat.environment import setting, variable

logger = logging.getLogger("ms_llm.ops.cpu_kernels")

LIB_NAME = "libmsllm_cpu_kernels.so"
BLAS_LIB_NAME = "libmsllm_blas_kernels.so"
_SRC_DIR = Path(__file__).resolve().parent
_BASE_FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden"]
_OPENMP_FLAG = "-fopenmp"
_COMPILE_TIMEOUT_S = 300



def _is_blas_source(p: Path) -> bool:
    return p.name.startswith("blas_")


def sources() -> list[Path]:
    """The C++ sources of the main library (every ``*.cpp``/``*.h`` under this folder but ``blas_*``
    and ``dnnl_*``, which build their own libraries: :mod:`.gemm.dnnl`)."""
    return sorted(p for p in list(_SRC_DIR.rglob("*.cpp")) + list(_SRC_DIR.rglob("*.h"))
                  if not _is_blas_source(p) and not p.name.startswith("dnnl_"))


def blas_sources() -> list[Path]:
    """The C++ sources of the BLAS library (``blas_*.cpp`` / ``blas_*.h`` under this folder, and
    the shared ``cpu_math.h``)."""
    return sorted(p for p in list(_SRC_DIR.rglob("blas_*.cpp")) + list(_SRC_DIR.rglob("blas_*.h"))
                  + [_SRC_DIR / "cpu_math.h"])


def _compiler() -> str | None:
    cxx = variable("MS_LLM_CXX") or os.environ.get("CXX") or "g++"
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
    root = variable("MS_LLM_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "ms_llm"
    return base / "kernels"


def build_key(cxx: str, flags: list[str], srcs: list[Path] | None = None, extra: tuple[str, ...] = ()) -> str:
    """Cache key: hash of the sources (default: the main library's), the compiler command and version,
    the MindSpore version, the CPU identity and any ``extra`` strings."""
    h = hashlib.sha256()
    for src in sources() if srcs is None else srcs:
        h.update(src.name.encode())
        h.update(src.read_bytes())
    for part in (cxx, " ".join(flags), _compiler_version(cxx), _mindspore_version(), _cpu_identity(), *extra):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:20]


def _run(cmd: list[str], cwd: Path) -> tuple[bool, str]:
    try:
        proc = subprocess.run(cmd, cwd=str(cwd), capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"{type(e).__name__}: {e}"
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def _check_library(path: Path, abi_symbol: str = "MsLlmKernelsAbiVersion", abi_version: int = 1) -> str | None:
    """Load the library once with ctypes; returns an error string or None."""
    try:
        lib = ctypes.CDLL(str(path))
        if getattr(lib, abi_symbol)() != abi_version:
            return "ABI version mismatch"
    except (OSError, AttributeError) as e:
        return f"cannot load {path}: {e}"
    return None


class Library:
    """One shared library built from C++ sources: the kernels' next to this file, and the
    shared-memory collectives' beside ``parallel.comm.shm`` (which builds them the same way).

    ``flag_sets()`` returns the (compile flags, link flags) pairs to try in order, as ``(flags, libs,
    note)``; the first pair is the preferred build and is the one hashed into the cache key, the
    later ones are fallbacks (``note`` says what is lost, logged as a warning when one is used). It
    is called at build time and may raise RuntimeError for a missing prerequisite: that becomes the
    library's :meth:`reason`.
    """

    def __init__(self, label, lib_name, abi_symbol, srcs, flag_sets, key_extra=lambda: (), fallback_msg=None):
        self.label = label  # used in log messages: "ms_llm <label>: ..."
        self.lib_name = lib_name
        self.abi_symbol = abi_symbol
        self.srcs = srcs
        self.flag_sets = flag_sets
        self.key_extra = key_extra
        self.fallback_msg = fallback_msg
        self.lock = threading.Lock()
        self.state: dict = {"done": False, "path": None, "reason": None}

    def check(self, path: Path) -> str | None:
        return _check_library(path, self.abi_symbol)

    def compile(self, cxx: str, out_dir: Path, sets) -> Path:
        """Compile into out_dir (caller holds the lock), trying each flag set in turn."""
        target = out_dir / self.lib_name
        srcs = [str(s) for s in self.srcs() if s.suffix == ".cpp"]
        errors = []
        for n, (flags, libs, note) in enumerate(sets):
            tmp = out_dir / f".{self.lib_name}.{os.getpid()}.{threading.get_ident()}.tmp"
            # -I: the headers every domain folder shares (cpu_math.h, blas_gemm.h) sit here
            ok, log = _run([cxx, *flags, f"-I{_SRC_DIR}", "-o", str(tmp), *srcs, *libs], out_dir)
            if ok:
                err = self.check(tmp)
                if err is None:
                    os.replace(tmp, target)
                    if n > 0:
                        logger.warning("ms_llm %s: built %s: %s", self.label, note, errors[-1])
                    return target
                log = err
            tmp.unlink(missing_ok=True)
            errors.append(f"{' '.join([cxx, *flags, *libs])}: {log[-2000:]}")
        raise RuntimeError("compilation failed:\n" + "\n".join(errors))

    def key(self, cxx: str, sets) -> str:
        flags, libs, _ = sets[0]
        return build_key(cxx, flags + libs, self.srcs(), tuple(self.key_extra()))

    def build(self) -> Path:
        if platform.system() != "Linux":
            raise RuntimeError(f"AOT custom ops need Linux, this is {platform.system()}")
        cxx = _compiler()
        if cxx is None:
            raise RuntimeError("no C++ compiler found (looked for $MS_LLM_CXX, $CXX, g++)")
        sets = self.flag_sets()
        key = self.key(cxx, sets)
        out_dir = cache_root() / key
        target = out_dir / self.lib_name
        if target.exists() and self.check(target) is None:
            return target
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # read-only home: build in a per-user temp dir instead
            fallback = Path(tempfile.gettempdir()) / f"ms_llm-{os.getuid()}" / "kernels" / key
            logger.warning("ms_llm %s: cannot create %s (%s), using %s", self.label, out_dir, e, fallback)
            out_dir, target = fallback, fallback / self.lib_name
            out_dir.mkdir(parents=True, exist_ok=True)
        with open(out_dir / ".lock", "w") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                if target.exists() and self.check(target) is None:  # built by another process meanwhile
                    return target
                logger.info("ms_llm %s: compiling %s -> %s", self.label, [s.name for s in self.srcs()], target)
                return self.compile(cxx, out_dir, sets)
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)

    def path(self) -> Path | None:
        with self.lock:
            if not self.state["done"]:
                if _disabled():
                    self.state["reason"] = "disabled by MS_LLM_DISABLE_AOT"
                else:
                    try:
                        self.state["path"] = self.build()
                    except Exception as e:  # noqa: BLE001 - any failure means "use the fallback path"
                        self.state["reason"] = str(e)
                self.state["done"] = True
                if self.state["path"] is not None:
                    logger.info("ms_llm %s in use: %s", self.label, self.state["path"])
                else:
                    logger.warning("ms_llm %s unavailable, %s: %s", self.label, self.fallback_msg, self.state["reason"])
            return self.state["path"]

    def available(self) -> bool:
        if _disabled():  # honoured even after a successful build in this process
            if self.state["reason"] is None:
                self.state["reason"] = "disabled by MS_LLM_DISABLE_AOT"
                logger.warning("ms_llm %s disabled by MS_LLM_DISABLE_AOT, %s", self.label, self.fallback_msg)
            return False
        return self.path() is not None

    def reset(self) -> None:
        with self.lock:
            self.state.update(done=False, path=None, reason=None)


def main_flag_sets():
    # Read _BASE_FLAGS at call time (tests monkeypatch it). Without libgomp, -fopenmp-simd keeps the
    # vectorised loops and only the optional threading is lost.
    return [
        (_BASE_FLAGS + [_OPENMP_FLAG], [], ""),
        (_BASE_FLAGS + ["-fopenmp-simd"], [], "without OpenMP (single-threaded)"),
    ]


def openblas_info() -> dict:
    """Where scipy-openblas32 is: ``include_dir``, ``lib_dir``, ``library`` (link name), ``version``.
    Raises RuntimeError (the reason the BLAS kernels are unavailable) when it is missing or incomplete."""
    try:
        import scipy_openblas32 as sob
    except ImportError as e:
        raise RuntimeError(f"scipy-openblas32 is not installed (pip install scipy-openblas32): {e}") from e
    try:
        info = {
            "include_dir": sob.get_include_dir(),
            "lib_dir": sob.get_lib_dir(),
            "library": sob.get_library(),
            "version": str(getattr(sob, "__version__", "unknown")),
        }
    except Exception as e:  # noqa: BLE001 - e.g. an empty lib dir
        raise RuntimeError(f"scipy-openblas32 is incomplete: {type(e).__name__}: {e}") from e
    if not (Path(info["include_dir"]) / "cblas.h").is_file():
        raise RuntimeError(f"scipy-openblas32: no cblas.h in {info['include_dir']}")
    return info


def _blas_flag_sets():
    ob = openblas_info()
    libs = [f"-L{ob['lib_dir']}", f"-l{ob['library']}", f"-Wl,-rpath,{ob['lib_dir']}"]
    # BLAS kernels use no OpenMP threads of their own (OpenBLAS has its own pool): -fopenmp-simd only;
    # -pthread for the attention kernel's std::threads (blas_attention.cpp).
    return [(_BASE_FLAGS + ["-fopenmp-simd", "-pthread", f"-I{ob['include_dir']}"], libs, "")]


def _blas_key_extra():
    ob = openblas_info()
    return ("scipy-openblas32 " + ob["version"],)


_MAIN = Library(
    "AOT kernels",
    LIB_NAME,
    "MsLlmKernelsAbiVersion",
    sources,
    main_flag_sets,
    fallback_msg="using composed MindSpore ops",
)
_BLAS = Library(
    "BLAS kernels",
    BLAS_LIB_NAME,
    "MsLlmBlasKernelsAbiVersion",
    blas_sources,
    _blas_flag_sets,
    key_extra=_blas_key_extra,
    fallback_msg="use MindSpore matmul",
)
# Kept for the existing callers/tests: the main library's state dict and lock.
_state = _MAIN.state
_lock = _MAIN.lock


def _compile(cxx: str, out_dir: Path) -> Path:
    return _MAIN.compile(cxx, out_dir, main_flag_sets())


def _build() -> Path:
    return _MAIN.build()


def _disabled() -> bool:
    return not setting("runtime.aot_kernels")


def library_path() -> Path | None:
    """Path of the built library, building it if needed; None when unavailable (see :func:`reason`)."""
    return _MAIN.path()


def available() -> bool:
    """True when the AOT kernels are built and loadable. Logs the reason once when they are not."""
    return _MAIN.available()


def reason() -> str | None:
    """Why the kernels are unavailable (None if available or not yet probed)."""
    return _MAIN.state["reason"]


def blas_library_path() -> Path | None:
    """Path of the BLAS kernel library, building it if needed; None when unavailable (see
    :func:`blas_reason`), e.g. scipy-openblas32 is not installed."""
    return _BLAS.path()


def blas_available() -> bool:
    """True when the BLAS kernels (linear, bmm) are built and loadable. Logs the reason once when not."""
    return _BLAS.available()


def blas_reason() -> str | None:
    """Why the BLAS kernels are unavailable (None if available or not yet probed)."""
    return _BLAS.state["reason"]


def _reset_for_tests() -> None:
    _MAIN.reset()
    _BLAS.reset()
