"""The collective watchdog: turns a collective that never completes into a process exit.

Every blocking collective call and every ``Work.wait`` runs under ``watched``; once
``set_collective_timeout`` is set, a daemon thread aborts the process when one of them outlasts
it (why: see ``set_collective_timeout``).
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Iterator, Optional

from .groups import get_rank

_WATCH = {"timeout": None, "op": None, "since": None, "thread": None}


def set_collective_timeout(seconds: Optional[float]) -> None:
    """Abort this process (exit code 124) when one collective blocks longer than ``seconds``.

    msrun notices a worker that exits or dies (its cluster time-out), but not a live worker stuck
    in a collective its peers never join (mismatched calls, a peer stuck elsewhere). This watchdog
    turns such a hang into an exit, which msrun then propagates to the whole job."""
    _WATCH["timeout"] = seconds
    if seconds and _WATCH["thread"] is None:
        t = threading.Thread(target=_watchdog, name="ms_llm-collective-watchdog", daemon=True)
        _WATCH["thread"] = t
        t.start()


def _watchdog() -> None:
    while True:
        time.sleep(min(5.0, max(0.5, (_WATCH["timeout"] or 5.0) / 4)))
        since, limit = _WATCH["since"], _WATCH["timeout"]
        if since is not None and limit and time.time() - since > limit:
            sys.stderr.write(f"ms_llm: rank {get_rank()}: collective {_WATCH['op']} did not "
                             f"complete within {limit:.0f} s (parallel.collective_timeout_s); "
                             f"aborting\n")
            sys.stderr.flush()
            os._exit(124)


@contextlib.contextmanager
def watched(op: str) -> Iterator[None]:
    """Time the block as collective ``op`` (the outermost one only: a ``wait`` inside a watched
    call keeps the outer call's start time)."""
    if not _WATCH["timeout"] or _WATCH["since"] is not None:
        yield
        return
    _WATCH["op"], _WATCH["since"] = op, time.time()
    try:
        yield
    finally:
        _WATCH["since"] = None
