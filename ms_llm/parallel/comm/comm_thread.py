"""The communication thread: where asynchronous CPU compositions run their kernels.

MindSpore's CPU collectives block the calling thread even with ``async_op=True``, so overlapping
communication with compute needs a second thread (``submit``). Any collective issued from another
thread first drains this thread's queue (``drain``), so every rank issues its collectives in one
order.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional, Tuple

from .watchdog import watched
from .work import Work

_COMM = {"executor": None, "pending": [], "local": threading.local()}


class _ThreadWork(Work):
    """A collective running on the communication thread; ``wait()`` joins it (and re-raises
    its error in the caller)."""

    def __init__(self, future, then: Optional[Callable[[], None]] = None):
        super().__init__(then=then)
        self._future = future
        self.timing: Optional[Tuple[float, float]] = None   # perf_counter start/end on the thread

    def wait(self) -> bool:
        if not self._done:
            with watched("wait"):
                self.timing = self._future.result()
            if self._then is not None:
                self._then()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done or self._future.done()


def submit(fn: Callable[[], None], then: Optional[Callable[[], None]] = None) -> Work:
    """Run the collective kernels ``fn`` on the communication thread; ``then`` runs on the
    caller's thread in ``wait()``. Only kernel launches cross threads: buffers are made and read
    by the caller (MindSpore's PyNative executor is not safe for concurrent tensor ops)."""
    if _COMM["executor"] is None:
        from concurrent.futures import ThreadPoolExecutor

        def mark():
            _COMM["local"].comm_thread = True
        _COMM["executor"] = ThreadPoolExecutor(1, thread_name_prefix="ms_llm-comm",
                                               initializer=mark)

    def timed():
        t0 = time.perf_counter()
        fn()
        return t0, time.perf_counter()
    fut = _COMM["executor"].submit(timed)
    _COMM["pending"] = [f for f in _COMM["pending"] if not f.done()] + [fut]
    return _ThreadWork(fut, then)


def drain() -> None:
    """Called before any collective on a non-communication thread: finish queued ones first."""
    if _COMM["pending"] and not getattr(_COMM["local"], "comm_thread", False):
        pending, _COMM["pending"] = _COMM["pending"], []
        for fut in pending:
            fut.result()


def shutdown() -> None:
    """Finish queued work and end the communication thread (process exit: see ``teardown``);
    a later ``submit`` starts a new one."""
    drain()
    executor, _COMM["executor"] = _COMM["executor"], None
    if executor is not None:
        executor.shutdown(wait=True)
