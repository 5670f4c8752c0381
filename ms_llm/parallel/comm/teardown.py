"""Ending a distributed process in order: this package's threads and shared memory go before
the interpreter and MindSpore tear themselves down.

Why: at interpreter exit, objects still alive are freed during module teardown in no set order,
and MindSpore finalizes its cluster connection from its own exit path. A worker of a finished
msrun job has been seen to die with SIGSEGV there, after its last line of output (a 4-worker
job under CI, once in about five suite runs; not reproduced in 30 local runs). Stopping the
watchdog and communication threads, unmapping the shared-memory channels and collecting the
tensors held only by garbage cycles while everything is still alive leaves that exit path
nothing of ours to touch. ``init_distributed`` registers ``release`` with ``atexit`` (which runs
before module teardown); ``ms_llm.launch.msrun`` sets ``PYTHONFAULTHANDLER`` for msrun workers, so a
crash that still happens prints its Python stack into the worker's log.
"""
from __future__ import annotations

import gc
import logging

from . import comm_thread, shm, watchdog

log = logging.getLogger("ms_llm.parallel")


def release() -> None:
    """Stop the watchdog and communication threads, drop the shared-memory channels, collect
    garbage. Safe to call more than once and in a single process."""
    try:
        comm_thread.shutdown()
    except Exception as e:   # a failed queued collective was already reported by its wait()
        log.warning("ms_llm.parallel: the communication thread ended with %s: %s",
                    type(e).__name__, e)
    watchdog.stop_watchdog()
    shm.reset()
    gc.collect()
