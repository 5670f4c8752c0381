"""Finding a checkpoint to resume from, and telling complete ones from interrupted ones.

A checkpoint is complete when its ``metadata.json`` exists (rank 0 writes it last) and every
file it lists has its recorded size (``verify="crc"``: and its recorded crc32). Discovery never
offers an incomplete one: it falls back to the newest complete checkpoint and says why.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Optional

from .format import METADATA, TRACKER, DCPError, list_iters, read_json
from ..verify import verify_checkpoint

log = logging.getLogger("ms_llm.checkpoint")


def check_complete(path: str, verify: str = "size") -> Optional[str]:
    """``None`` if ``path`` is a complete checkpoint, else the reason it is not.

    ``verify``: ``"size"`` (metadata present and well-formed, every file with its recorded size)
    or ``"crc"`` (also re-reads every file and compares its crc32); ``checkpoint.verify``."""
    if verify not in ("size", "crc"):
        raise DCPError(f"verify: expected 'size' or 'crc', got {verify!r}")
    return verify_checkpoint(path, crc=verify == "crc")


def read_state(path: str) -> dict:
    """The ``state`` dict saved with a complete checkpoint."""
    reason = check_complete(path)
    if reason:
        raise DCPError(f"{path}: not a complete checkpoint ({reason})")
    return read_json(os.path.join(path, METADATA))["state"]


def find_latest_complete(save_dir: Optional[str], verify: str = "crc",
                         report: Optional[Callable[[str], None]] = None) -> Optional[str]:
    """The newest complete ``iter_*`` in ``save_dir`` (None if there is none).

    Newer incomplete checkpoints (metadata missing, a shard truncated) are skipped and reported
    through ``report`` (default: a log warning), including when the tracker names one of them.
    ``verify="crc"`` (default) re-reads every file: a flipped byte is found here, not after
    training on it."""
    say = report or log.warning
    if not save_dir or not os.path.isdir(save_dir):
        return None
    tracker, tracked = os.path.join(save_dir, TRACKER), None
    if os.path.isfile(tracker):
        with open(tracker, "rb") as f:
            text = f.read(64).decode("ascii", "replace").strip()
        tracked = int(text) if text.isascii() and text.isdigit() else None
        if tracked is None:
            say(f"{tracker}: ignoring unreadable content {text!r}")
    skipped = []
    for step, path in reversed(list_iters(save_dir)):
        reason = check_complete(path, verify)
        if reason is None:
            if skipped:
                say(f"resume: skipping incomplete or corrupt checkpoint(s) "
                    f"{'; '.join(skipped)}; falling back to {path}")
            elif tracked is not None and tracked != step:
                say(f"resume: {tracker} names iteration {tracked}, using newest complete {path}")
            return path
        skipped.append(f"{path} ({reason})")
    if skipped:
        say(f"resume: no complete checkpoint in {save_dir}: {'; '.join(skipped)}")
    return None


def resolve_resume(resume, save_dir: Optional[str],
                   report: Optional[Callable[[str], None]] = None) -> Optional[str]:
    """``training.resume``: ``auto`` -> newest complete checkpoint in ``save_dir`` (or None to
    start fresh); ``None``/``false``/``"none"`` -> None; a path -> that checkpoint, which must
    be complete (an explicit request for a broken checkpoint is an error, not a fallback)."""
    if resume in (None, False, "none", "None", "", "false"):
        return None
    if resume == "auto":
        return find_latest_complete(save_dir, "crc", report=report)
    path = str(resume)
    if os.path.isfile(os.path.join(path, TRACKER)) and not os.path.isfile(
            os.path.join(path, METADATA)):
        found = find_latest_complete(path, "crc", report=report)
        if found is None:
            raise DCPError(f"training.resume: {path} holds no complete checkpoint")
        return found
    reason = check_complete(path, "crc")
    if reason:
        raise DCPError(f"training.resume: {path} is not a complete checkpoint ({reason})")
    return path
