"""Single-process training checkpoints: model, optimizer and loop state, saved atomically.

Layout: ``<save_dir>/iter_0000010/{model.safetensors, optimizer.safetensors, state.json}`` and
``<save_dir>/latest_checkpointed_iteration.txt`` (Megatron's tracker name). A checkpoint is
built in a hidden temp folder and renamed into place; the tracker is updated only afterwards,
so an interrupted save never looks complete. (Sharded, reshardable checkpoints: issue 5.)
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import numpy as np
from safetensors.numpy import load_file, save_file

from ms_llm.compat import load_state_dict, state_dict

TRACKER = "latest_checkpointed_iteration.txt"


def _iter_dir(save_dir: str, step: int) -> str:
    return os.path.join(save_dir, f"iter_{step:07d}")


def save_training_state(save_dir: str, step: int, model, optimizer, data_state: dict) -> str:
    os.makedirs(save_dir, exist_ok=True)
    final = _iter_dir(save_dir, step)
    tmp = os.path.join(save_dir, f".tmp_iter_{step:07d}_{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file({k: p.asnumpy() for k, p in state_dict(model).items()},
              os.path.join(tmp, "model.safetensors"))
    save_file(optimizer.state_dict(), os.path.join(tmp, "optimizer.safetensors"))
    with open(os.path.join(tmp, "state.json"), "w", encoding="utf-8") as f:
        json.dump({"step": step, "data": data_state}, f)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(tmp, final)
    tracker_tmp = os.path.join(save_dir, f".{TRACKER}.tmp")
    with open(tracker_tmp, "w", encoding="utf-8") as f:
        f.write(str(step))
    os.replace(tracker_tmp, os.path.join(save_dir, TRACKER))
    return final


def find_latest(save_dir: Optional[str]) -> Optional[str]:
    if not save_dir:
        return None
    tracker = os.path.join(save_dir, TRACKER)
    if not os.path.isfile(tracker):
        return None
    with open(tracker, encoding="utf-8") as f:
        text = f.read().strip()
    try:
        step = int(text)
    except ValueError:
        raise ValueError(f"{tracker}: expected an iteration number, got {text!r}") from None
    path = _iter_dir(save_dir, step)
    if not os.path.isfile(os.path.join(path, "state.json")):
        raise FileNotFoundError(f"{tracker} names iteration {step} but {path} is incomplete")
    return path


def load_training_state(path: str, model, optimizer) -> dict:
    load_state_dict(model, load_file(os.path.join(path, "model.safetensors")), strict=True,
                    source=os.path.join(path, "model.safetensors"))
    opt_file = os.path.join(path, "optimizer.safetensors")
    optimizer.load_state_dict({k: np.asarray(v) for k, v in load_file(opt_file).items()},
                              source=opt_file)
    with open(os.path.join(path, "state.json"), encoding="utf-8") as f:
        return json.load(f)
