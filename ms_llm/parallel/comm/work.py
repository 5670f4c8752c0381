"""``Work``: the handle a possibly asynchronous collective returns, as in torch.distributed.

Synchronous calls finish inside the collective (``finish``); asynchronous ones hand the caller a
``Work`` whose ``wait()`` joins the kernels and then runs the local step that completes the op
(a copy, a combine, a division), so every composition has the same two-phase shape.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

from .watchdog import watched


class Work:
    """Handle of a possibly asynchronous collective; ``wait()`` blocks and finishes it."""

    def __init__(self, handles: Sequence = (), then: Optional[Callable[[], None]] = None):
        self._handles, self._then, self._done = list(handles), then, False
        self.timing: Optional[Tuple[float, float]] = None   # known for thread-run collectives

    def wait(self) -> bool:
        if not self._done:
            with watched("wait"):
                for h in self._handles:
                    if h is not None:
                        h.wait()
            if self._then is not None:
                self._then()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done


def finish(work: Work, async_op: bool) -> Optional[Work]:
    """torch's return convention: the handle when asynchronous, else wait here and return None."""
    if async_op:
        return work
    work.wait()
    return None
