"""Megatron's timers: named wall-clock intervals of a training step, gated by
``training.timing_log_level`` and reported as (min, max) over all ranks.

Names and levels follow Megatron-LM (``megatron/core/timers.py`` and its training loop):

=====================  =====  =========================================================
name                   level  what it covers here
=====================  =====  =========================================================
``batch-generator``    1      reading the step's micro-batches from the loader
``forward-backward``   1      every micro-batch's forward and backward, and the gradient
                              reduction over data parallel (Megatron's
                              ``finalize_model_grads`` runs inside it too)
``grads-all-reduce``   1      the data-parallel gradient all-reduce (nested in the above);
``grads-reduce-scatter``      its name under the distributed optimizer / FSDP
``optimizer``          1      global grad norm, clipping and the update
``params-all-gather``  1      the distributed optimizer's all-gather of the updated
                              parameter shards (nested in ``optimizer``)
``forward-compute``    2      the model's forward calls (nested in ``forward-backward``)
``backward-compute``   2      ``forward-backward``'s gradient computation minus the
                              forward calls inside it (pipeline: the B actions' spans)
``pipeline-send-recv`` 2      pipeline parallel: the activation / gradient exchanges
                              of every schedule round (Megatron splits these into
                              ``forward-send``, ``backward-recv``...; here one round
                              is one batched exchange)
=====================  =====  =========================================================

Level 0 (the default) creates no timer at all: only the iteration time the step line always
shows, so the default run has no added device synchronisation and no extra collective. Levels 1
and 2 synchronise the device at each timer boundary (Megatron does the same; on CPU the ops
already run synchronously under ``ms_llm.compat.setup_device``'s default, so nothing is added
there), and each logged step gathers every rank's timers once (one ``all_gather`` of a few
floats over the world group) for the min/max columns. Differences from Megatron: the batch
generator is read before the micro-batch loop (it is not nested in ``forward-backward``), and
under ``training.jit`` the compiled forward+backward is one call, so ``forward-compute`` /
``backward-compute`` are not reported there.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

LEVELS: Dict[str, int] = {
    "batch-generator": 1, "forward-backward": 1, "grads-all-reduce": 1,
    "grads-reduce-scatter": 1, "optimizer": 1, "params-all-gather": 1, "forward-compute": 2, "backward-compute": 2,
    "pipeline-send-recv": 2,
}
# The top-level timers: disjoint, and together they make up nearly the whole step.
TOP_LEVEL = ("batch-generator", "forward-backward", "optimizer")


def device_sync() -> None:
    """Wait for the device's queued work. On Ascend ``mindspore.runtime.synchronize``; on CPU
    ``setup_device`` runs PyNative synchronously by default, so there is nothing queued."""
    from ms_llm.compat import is_ascend
    if is_ascend():
        import mindspore as ms
        ms.runtime.synchronize()


class Timer:
    """One named interval; accumulates between ``elapsed(reset=True)`` reads."""

    def __init__(self, name: str, sync: Callable[[], None]):
        self.name, self._sync = name, sync
        self.total, self.count, self._started = 0.0, 0, None

    def start(self) -> None:
        if self._started is not None:
            raise RuntimeError(f"timer {self.name!r} started twice")
        self._sync()
        self._started = time.perf_counter()

    def stop(self) -> None:
        if self._started is None:
            raise RuntimeError(f"timer {self.name!r} stopped before it started")
        self._sync()
        self.total += time.perf_counter() - self._started
        self.count += 1
        self._started = None

    def add(self, seconds: float) -> None:
        """Credit an interval measured elsewhere (``backward-compute`` is derived)."""
        self.total += seconds
        self.count += 1

    def __enter__(self) -> "Timer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class _NullTimer:
    """A timer above the configured level: does nothing, costs one attribute lookup."""

    total, count = 0.0, 0

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def add(self, seconds: float) -> None:
        pass

    def __enter__(self) -> "_NullTimer":
        return self

    def __exit__(self, *exc) -> None:
        pass


_NULL = _NullTimer()


class Timers:
    """``timers(name)`` is a real ``Timer`` when the name's level is within ``log_level``."""

    def __init__(self, log_level: int, sync: Callable[[], None] = device_sync):
        if log_level not in (0, 1, 2):
            raise ValueError(f"training.timing_log_level must be 0, 1 or 2, got {log_level!r}")
        self.log_level, self._sync = log_level, sync
        self._timers: Dict[str, Timer] = {}

    def __call__(self, name: str):
        level = LEVELS.get(name)
        if level is None:
            raise KeyError(f"unknown timer {name!r}; known: {', '.join(LEVELS)}")
        if level > self.log_level:
            return _NULL
        if name not in self._timers:
            self._timers[name] = Timer(name, self._sync)
        return self._timers[name]

    @property
    def enabled(self) -> bool:
        return self.log_level > 0

    def names(self) -> List[str]:
        """Every name this level can report, in a fixed order (the same on every rank)."""
        return [n for n, lv in LEVELS.items() if lv <= self.log_level]

    def read_ms(self, normalizer: int = 1) -> np.ndarray:
        """This rank's times (ms per step, averaged over ``normalizer`` steps) in ``names()``
        order, 0 for a timer that did not run; then every timer restarts from zero."""
        names = self.names()
        out = np.zeros(len(names), np.float64)
        for i, name in enumerate(names):
            t = self._timers.get(name)
            if t is not None and t.count:
                out[i] = t.total * 1000.0 / max(1, normalizer)
                t.total, t.count = 0.0, 0
        if "backward-compute" in names and out[names.index("backward-compute")] == 0 \
                and out[names.index("forward-compute")] > 0:
            # derived: forward-backward less its forward calls and its gradient reduction
            fb = out[names.index("forward-backward")]
            sync = out[names.index("grads-all-reduce")] + out[names.index("grads-reduce-scatter")]
            out[names.index("backward-compute")] = max(
                fb - out[names.index("forward-compute")] - sync, 0.0)
        return out


def min_max_over_ranks(names: Sequence[str], per_rank: np.ndarray) -> Dict[str, Dict[str, float]]:
    """``{name: {"min": ms, "max": ms}}`` over the ranks where the timer ran (Megatron skips
    ranks with no time for a name, e.g. a pipeline stage that has no loss)."""
    out = {}
    for i, name in enumerate(names):
        col = per_rank[:, i]
        col = col[col > 0.0]
        if col.size:
            out[name] = {"min": float(col.min()), "max": float(col.max())}
    return out


def gather_min_max(timers: Timers, normalizer: int,
                   all_gather: Optional[Callable[[np.ndarray], np.ndarray]] = None
                   ) -> Dict[str, Dict[str, float]]:
    """Collective when ``all_gather`` is given (every rank must call it on the same step)."""
    mine = timers.read_ms(normalizer)
    rows = all_gather(mine) if all_gather is not None else mine[None, :]
    return min_max_over_ranks(timers.names(), rows)


def format_block(stats: Dict[str, Dict[str, float]]) -> str:
    """Megatron's ``--timing-log-option minmax`` block."""
    lines = ["(min, max) time across ranks (ms):"]
    for name, mm in stats.items():
        lines.append(f"    {name + ' ':.<40}: ({mm['min']:.2f}, {mm['max']:.2f})")
    return "\n".join(lines)
