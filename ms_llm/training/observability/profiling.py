"""``training.profile``: MindSpore's Profiler over a window of steps on chosen ranks.

Megatron's flags: ``profile_step_start`` / ``profile_step_end`` bound the profiled steps
``[start, end)`` (1-based, as Megatron's iteration counter), ``profile_ranks`` the global ranks
that record (default ``[0]``). Each profiled rank writes under ``<profile_dir>/rank_<r>/``
(``profile_dir`` defaults to ``<output_dir>/profile``) and the trace a person opens is
``.../ASCEND_PROFILER_OUTPUT/trace_view.json``: Chrome trace-event JSON, which Perfetto
(https://ui.perfetto.dev, "Open trace file") and ``chrome://tracing`` load as they are. On CPU
it holds the host-side kernels (``MatMul``, ``AddExt``...); on Ascend the NPU activity is
recorded too (``ProfilerActivity.NPU``; not run in this project's CPU-only CI).
"""
from __future__ import annotations

import glob
import os
from typing import Callable, List, Optional, Sequence

VIEWER_HINT = "open it in https://ui.perfetto.dev (Open trace file) or chrome://tracing"


def trace_files(rank_dir: str) -> List[str]:
    """The viewer-readable traces under one rank's profile folder (newest last)."""
    found = glob.glob(os.path.join(rank_dir, "**", "ASCEND_PROFILER_OUTPUT", "trace_view.json"),
                      recursive=True)
    return sorted(found, key=os.path.getmtime)


class StepProfiler:
    """Starts MindSpore's Profiler at the beginning of step ``start`` and stops (and analyses)
    it after step ``end - 1``, on the ranks in ``ranks`` only."""

    def __init__(self, start: int, end: int, ranks: Sequence[int], profile_dir: str, rank: int,
                 say: Callable[[str], None] = print, ascend: bool = False):
        if end <= start:
            raise ValueError(f"training.profile_step_end ({end}) must be > "
                             f"training.profile_step_start ({start})")
        self.start, self.end = start, end
        self.active = rank in set(ranks)
        self.rank_dir = os.path.join(profile_dir, f"rank_{rank}")
        self._say, self._ascend, self._prof = say, ascend, None

    def _make(self):
        from mindspore.profiler import ProfilerActivity, profile, tensorboard_trace_handler
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.NPU] if self._ascend else [])
        return profile(activities=activities, record_shapes=True,
                       on_trace_ready=tensorboard_trace_handler(self.rank_dir,
                                                                analyse_flag=True))

    def on_step_begin(self, step: int) -> None:
        if self.active and step == self.start and self._prof is None:
            os.makedirs(self.rank_dir, exist_ok=True)
            self._prof = self._make()
            self._prof.start()

    def on_step_end(self, step: int) -> Optional[str]:
        if self._prof is not None and step >= self.end - 1:
            return self._finish()
        return None

    def on_train_end(self) -> Optional[str]:
        """A run that ends inside the window still gets its (shorter) trace."""
        return self._finish() if self._prof is not None else None

    def _finish(self) -> Optional[str]:
        prof, self._prof = self._prof, None
        prof.stop()     # runs on_trace_ready: the analysis that writes trace_view.json
        traces = trace_files(self.rank_dir)
        if not traces:
            self._say(f"profiler: no trace_view.json under {self.rank_dir} (see its logs/)")
            return None
        self._say(f"profile of steps {self.start}-{self.end - 1}: {traces[-1]} ({VIEWER_HINT})")
        return traces[-1]
