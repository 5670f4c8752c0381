"""Shared pytest setup for ms-llm tests.

Layout: ``tests/<package>/test_*.py`` tests ``ms_llm.<package>`` (``docs/`` the README's commands,
``architecture/`` the import rules); the code tests share is the ``helpers`` package, never another
test module; ``dist_workers/`` holds the scripts msrun runs, ``fixtures/`` checked-in data. The
folders have no ``__init__.py`` (pytest imports each test file as a top-level module), so test file
names are unique across folders."""
import os
import sys

# tests/ on the path: the test modules import their shared code as the `helpers` package.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from ms_llm.compat import setup_device  # noqa: E402

# The trainer's MFU peak probe (ms_llm.planning.peak) caches per host; a probe taken while the
# suite loads the machine would measure low, so the suite keeps its own file (probed once per
# run, inherited by subprocesses) instead of writing the user's ~/.cache/ms_llm one.
if "MS_LLM_PEAK_FILE" not in os.environ:
    import tempfile
    _RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID", str(os.getpid()))   # shared by xdist workers
    os.environ["MS_LLM_PEAK_FILE"] = os.path.join(tempfile.gettempdir(),
                                                  f"ms_llm_test_peak_{_RUN}.json")

# Under pytest-xdist each worker process gets its share of the CPUs for the BLAS kernels (as
# default_blas_threads() shares them among msrun workers): OpenBLAS's idle threads spin for a
# while after every GEMM, so two processes with a 2-thread pool each on 2 cores steal each other's
# (and their msrun jobs') cores. A value set by the caller wins; subprocesses inherit it.
_XDIST = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
if _XDIST > 1:
    _SHARE = str(max(1, len(os.sched_getaffinity(0)) // _XDIST))
    os.environ.setdefault("MS_LLM_BLAS_THREADS", _SHARE)

# PyNative errors are sticky without synchronous execution: a failing op would otherwise
# re-raise its stale error from the next unrelated op and poison later tests.
setup_device("CPU", synchronize=True)


def pytest_collection_modifyitems(config, items):
    """Files with the most msrun jobs first (a stable sort: tests keep their order inside a
    file). Under pytest-xdist's ``--dist loadfile`` the longest files then start at once and the
    many short files fill in around them, instead of one worker ending the run alone on a long
    file."""
    jobs = {}
    for item in items:
        jobs[item.fspath] = jobs.get(item.fspath, 0) + bool(item.get_closest_marker("msrun"))
    items.sort(key=lambda item: -jobs[item.fspath])


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_working_folder():
    """A test that changes the working folder and fails (or forgets) must not move every later
    test in its xdist worker: scripts run by relative path would then not be found."""
    cwd = os.getcwd()
    yield
    if os.getcwd() != cwd:
        os.chdir(cwd)
