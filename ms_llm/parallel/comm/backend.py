"""The one access point to ``mindspore.mint.distributed``.

Every kernel call goes through ``dist()``, so each one first drains the communication thread
(collectives stay in one order on every rank) and runs under the collective watchdog. Which route
an op takes (native kernel or a CPU composition) is logged once per op.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from .comm_thread import drain
from .watchdog import watched

log = logging.getLogger("ms_llm.parallel")
_LOGGED: set = set()


def log_once(op: str, how: str) -> None:
    """Log the route ``how`` taken by collective ``op``, the first time only."""
    if op not in _LOGGED:
        _LOGGED.add(op)
        log.info("ms_llm.parallel.%s: %s", op, how)


class _WatchedDist:
    """``mindspore.mint.distributed`` with every call under the collective watchdog."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        import mindspore.mint.distributed as dist
        fn = getattr(dist, name)

        def call(*args, **kwargs):
            drain()
            with watched(name, kwargs.get("group")):
                return fn(*args, **kwargs)
        return call


_DIST = _WatchedDist()


def dist() -> _WatchedDist:
    """``mindspore.mint.distributed``, watched and ordered after the communication thread."""
    return _DIST
