"""The collective watchdog: turns a collective that never completes into a process exit.

Every blocking collective call and every ``Work.wait`` runs under ``watched``; once
``set_collective_timeout`` is set, a daemon thread aborts the process when one of them outlasts
it (why: see ``set_collective_timeout``).

The message says which rank gave up, in which collective over which ranks, at which training
step. The waiting rank is rarely the culprit, so with a status folder (``set_status_dir``: the
trainer uses ``<output_dir>/.rank_status``, on a folder every node sees) the watchdog thread also
writes this rank's state there on each tick (step, current collective, since when: one small file
every few seconds, nothing per collective) and, on time-out, reads its peers' files to name the
ranks that are not waiting in a collective (computing or stalled) or have stopped ticking (dead).
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import sys
import threading
import time
from typing import Iterator, Optional

from .groups import _STATE as _GROUPS, get_rank

_WATCH = {"timeout": None, "op": None, "since": None, "thread": None, "step": None,
          "status_dir": None, "stop": threading.Event()}


def set_collective_timeout(seconds: Optional[float]) -> None:
    """Abort this process (exit code 124) when one collective blocks longer than ``seconds``.

    msrun notices a worker that exits or dies (its cluster time-out), but not a live worker stuck
    in a collective its peers never join (mismatched calls, a peer stuck elsewhere). This watchdog
    turns such a hang into an exit, which msrun then propagates to the whole job."""
    _WATCH["timeout"] = seconds
    if seconds and _WATCH["thread"] is None:
        t = threading.Thread(target=_watchdog, args=(_WATCH["stop"],),
                             name="ms_llm-collective-watchdog", daemon=True)
        _WATCH["thread"] = t
        t.start()


def set_status_dir(path: Optional[str]) -> None:
    """Where every rank's watchdog thread publishes its state for its peers' time-out report."""
    if path:
        os.makedirs(path, exist_ok=True)
    _WATCH["status_dir"] = path


def note_step(step: int) -> None:
    """The training step this rank is in (named in the time-out report)."""
    _WATCH["step"] = step


def _tick() -> float:
    return min(5.0, max(0.5, (_WATCH["timeout"] or 5.0) / 4))


def _status_path(rank) -> str:
    return os.path.join(_WATCH["status_dir"], f"rank_{rank}.json")


def _publish() -> None:
    if not _WATCH["status_dir"]:
        return
    st = {"rank": get_rank(), "step": _WATCH["step"], "op": _WATCH["op"],
          "since": _WATCH["since"], "time": time.time()}
    tmp = _status_path(get_rank()) + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(st, f)
        os.replace(tmp, _status_path(get_rank()))
    except OSError:
        pass   # a report aid only: never let it kill training


def peer_report(now: Optional[float] = None) -> str:
    """One line per other rank from the status folder: waiting in which collective, computing
    outside any, or silent (dead or stuck outside Python)."""
    if not _WATCH["status_dir"]:
        return ""
    now, lines, suspects = now or time.time(), [], []
    for path in sorted(glob.glob(os.path.join(_WATCH["status_dir"], "rank_*.json"))):
        try:
            with open(path, encoding="utf-8") as f:
                st = json.load(f)
        except (OSError, ValueError):
            continue
        if st["rank"] == get_rank() or st["rank"] >= _GROUPS["world"]:
            continue   # this rank, or a stale file of a larger earlier job
        age = now - st["time"]
        if age > 3 * _tick() + 1:
            what = f"no heartbeat for {age:.0f} s (dead, or stuck outside Python)"
            suspects.append(st["rank"])
        elif st["since"] is not None:
            what = f"waiting in {st['op']} for {now - st['since']:.0f} s"
        else:
            what = "not in a collective (computing, or stalled there)"
            suspects.append(st["rank"])
        lines.append(f"rank {st['rank']}: step {st['step']}, {what}")
    if not lines:
        return ""
    head = f"; stalled rank(s): {suspects}" if suspects else ""
    return f"{head}; peers: " + "; ".join(lines)


def stop_watchdog() -> None:
    """End the watchdog thread (process exit: see ``teardown``); a later timeout starts anew."""
    t = _WATCH["thread"]
    if t is None:
        return
    _WATCH["stop"].set()
    t.join(timeout=10.0)
    _WATCH["thread"], _WATCH["stop"] = None, threading.Event()


def _watchdog(stop: threading.Event) -> None:
    while not stop.wait(_tick()):
        _publish()
        since, limit = _WATCH["since"], _WATCH["timeout"]
        if since is not None and limit and time.time() - since > limit:
            step = f" in step {_WATCH['step']}" if _WATCH["step"] is not None else ""
            sys.stderr.write(f"ms_llm: rank {get_rank()}: collective {_WATCH['op']} did not "
                             f"complete within {limit:.0f} s (parallel.collective_timeout_s)"
                             f"{step}{peer_report()}; aborting\n")
            sys.stderr.flush()
            os._exit(124)


def describe(op: str, group_name: Optional[str]) -> str:
    """``op`` with the global ranks of MindSpore group ``group_name`` (None: the world)."""
    if group_name is None or group_name == getattr(_GROUPS["world_group"], "name", None):
        return f"{op} over all {_GROUPS['world']} ranks"
    for g in _GROUPS["groups"].values():
        if g.name == group_name:
            return f"{op} over ranks {list(g.ranks)}"
    return f"{op} (group {group_name})"


@contextlib.contextmanager
def watched(op: str, group_name: Optional[str] = None) -> Iterator[None]:
    """Time the block as collective ``op`` (the outermost one only: a ``wait`` inside a watched
    call keeps the outer call's start time)."""
    if not _WATCH["timeout"] or _WATCH["since"] is not None:
        yield
        return
    _WATCH["op"] = describe(op, group_name) if group_name is not None else op
    _WATCH["since"] = time.time()
    try:
        yield
    finally:
        _WATCH["since"] = None
