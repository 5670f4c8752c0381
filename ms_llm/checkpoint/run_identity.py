"""A save folder belongs to one run.

Why: a fresh run (``training.resume none``, another seed or config) into a folder holding
another run's checkpoints used to overwrite that run's first iterations, keep its later ones
and point the tracker at its own, so the next ``resume auto`` continued a mix of two runs. Now
the first save writes ``run.json`` (a random run id) into the folder and every checkpoint's
state records the same ``run_id``; a run that resumes nothing refuses a folder that holds
checkpoints (any format), and ``resume auto`` refuses a newest checkpoint whose run id is not
the folder's (checkpoints of two runs mixed by an older ms-llm, or copied in by hand).
"""
from __future__ import annotations

import json
import os
import uuid
from typing import Optional

from .native.format import DCPError, list_iters

RUN_FILE = "run.json"
STATE_KEY = "run_id"
_FRESH_HINT = ("continue it with --training.resume auto, or give this run a new "
               "--checkpoint.save_dir")


def new_run_id() -> str:
    return uuid.uuid4().hex


def folder_run_id(save_dir: Optional[str]) -> Optional[str]:
    """The run id ``save_dir/run.json`` records, or None (no file: a folder of an older
    ms-llm, a Megatron folder or no save yet). A damaged file is refused in one line."""
    if not save_dir:
        return None
    path = os.path.join(save_dir, RUN_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            rid = json.load(f).get(STATE_KEY)
    except (OSError, ValueError, AttributeError) as e:
        raise DCPError(f"{path}: unreadable run identity ({type(e).__name__}); restore it or "
                       f"give this run a new --checkpoint.save_dir") from None
    if not isinstance(rid, str) or not rid:
        raise DCPError(f"{path}: 'run_id' must be a non-empty string, got {rid!r}")
    return rid


def claim(save_dir: str, run_id: str) -> None:
    """Rank 0, before the first save: record ``run_id`` as the folder's owner (written to a
    temporary name, then renamed). A folder already owned by this run is left as it is."""
    os.makedirs(save_dir, exist_ok=True)
    have = folder_run_id(save_dir)
    if have == run_id:
        return
    if have is not None:
        raise DCPError(f"checkpoint.save_dir {save_dir}: belongs to run {have}, not to this "
                       f"run ({run_id}); {_FRESH_HINT}")
    path = os.path.join(save_dir, RUN_FILE)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({STATE_KEY: run_id}, f)
    os.replace(tmp, path)


def _inside(save_dir: str, path: str) -> bool:
    return os.path.realpath(os.path.dirname(os.path.normpath(path))) == \
        os.path.realpath(save_dir)


def run_id_for(save_dir: Optional[str], resumed: Optional[str], state: dict) -> str:
    """The run id this run saves under, after checking that ``save_dir`` is its own.

    ``resumed`` is the checkpoint the run continues (None: it resumes nothing), ``state`` that
    checkpoint's state. A run that does not continue a checkpoint of ``save_dir`` refuses a
    folder holding ``iter_*`` checkpoints (of any format): its saves would replace the other
    run's and the tracker would name a mix. A run continuing a checkpoint of ``save_dir``
    whose run id is not the folder's is refused too (two runs already mixed there)."""
    if not save_dir:
        return new_run_id()
    if resumed is None or not _inside(save_dir, resumed):
        found = list_iters(save_dir)
        if found:
            owner = folder_run_id(save_dir)
            whose = f"run {owner}" if owner else "another run"
            how = "resumes nothing" if resumed is None else f"resumes {resumed}"
            raise DCPError(f"checkpoint.save_dir {save_dir}: holds the checkpoints of {whose} "
                           f"(newest {os.path.basename(found[-1][1])}) and this run {how}; "
                           f"{_FRESH_HINT}")
        return new_run_id()
    mine, owner = state.get(STATE_KEY), folder_run_id(save_dir)
    if owner and mine and mine != owner:
        raise DCPError(f"checkpoint.save_dir {save_dir}: {os.path.basename(resumed)} belongs "
                       f"to run {mine}, the folder to run {owner} (two runs mixed); move "
                       f"the other run's iter_* folders away, or resume with a new "
                       f"--checkpoint.save_dir")
    return mine or owner or new_run_id()
