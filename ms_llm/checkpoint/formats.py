"""Which checkpoint format a folder holds, and whether it is intact, for every format ms-llm
reads or writes: its own (``native``), Megatron-Core ``torch_dist`` and Megatron's legacy
``torch`` format (``iter_N/mp_rank_*/model_optim_rng.pt``, also ``checkpoint.format: torch``).

Why one module: ``ms-llm checkpoint verify`` and the trainer's resume fallback must judge a
folder the same way, whatever format wrote it. What is checked per format:

* native: ``metadata.json`` structure and every file's size and crc32 (``verify``);
* torch: every rank file opened through the restricted reader (sizes inside the file) and,
  with ``crc``, every zip entry's CRC-32;
* torch_dist: ``.metadata`` structure and byte ranges and ``common.pt``; with ``crc``, every
  tensor chunk read back (each is a ``torch.save`` blob: its CRC-32, size and dtype against
  ``.metadata``);
* a save folder's ``latest_checkpointed_iteration.txt`` must name an iteration whose folder
  exists (``tracker_problem``).
"""
from __future__ import annotations

import json
import os
from typing import Optional

from .native.format import FORMAT, METADATA, TRACKER

__all__ = ["checkpoint_format", "megatron_problem", "tracker_problem", "LEGACY_FILE"]

LEGACY_FILE = "model_optim_rng.pt"


def checkpoint_format(path: str) -> str:
    """``"torch_dist"``, ``"torch"`` or ``"native"`` (the default: an ``iter_*`` folder whose
    ``metadata.json`` is missing is an interrupted native save)."""
    backend = _backend(path)
    if backend == "torch_dist" or (backend is None and (
            os.path.isfile(os.path.join(path, ".metadata")) or
            any(n.endswith(".distcp") for n in _names(path)))):
        return "torch_dist"
    if backend is None and any(n.startswith("mp_rank_") for n in _names(path)):
        return "torch"
    return "native"


def _names(path: str) -> list:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _backend(path: str) -> Optional[str]:
    """``sharded_backend`` of a Megatron ``metadata.json`` (None: absent, or another file)."""
    try:
        with open(os.path.join(path, METADATA), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    if isinstance(meta, dict) and meta.get("format") != FORMAT:
        backend = meta.get("sharded_backend")
        return backend if isinstance(backend, str) else None
    return None


def megatron_problem(path: str, crc: bool = True) -> Optional[str]:
    """Why the Megatron ``iter_*`` folder ``path`` (torch_dist or legacy torch) cannot be
    resumed from or converted, or None."""
    fmt = checkpoint_format(path)
    try:
        if fmt == "torch_dist":
            return _torch_dist_problem(path, crc)
        if fmt == "torch":
            return _legacy_problem(path, crc)
    except (ValueError, OSError) as e:   # TorchFormatError is a ValueError naming the file
        return " ".join(str(e).split())
    return f"{path}: neither a torch_dist nor a legacy torch checkpoint"


def _torch_dist_problem(path: str, crc: bool) -> Optional[str]:
    from .torch_dist.io import BACKEND
    if _backend(path) != "torch_dist":
        return f"{os.path.join(path, BACKEND)} is missing or names no torch_dist backend"
    from .torch_dist.io import TorchDistReader
    reader = TorchDistReader(path)   # .metadata structure, byte ranges, common.pt
    if crc:
        for key in reader.tensors:
            reader.tensor(key)       # each chunk: CRC-32, size and dtype against .metadata
    return None


def _legacy_problem(path: str, crc: bool) -> Optional[str]:
    from .torch_pickle.reader import TorchCheckpoint
    ranks = sorted(n for n in _names(path) if n.startswith("mp_rank_"))
    for r in ranks:
        f = os.path.join(path, r, LEGACY_FILE)
        if not os.path.isfile(f):
            return f"{f} is missing"
        with TorchCheckpoint(f) as ck:   # data.pkl read through zipfile (its CRC checked)
            if crc:
                ck.archive.verify_storages()
    return None


def tracker_problem(folder: str) -> Optional[str]:
    """Why ``folder``'s ``latest_checkpointed_iteration.txt`` names no checkpoint here, or None
    (no tracker is fine: the newest ``iter_*`` is used)."""
    tracker = os.path.join(folder, TRACKER)
    if not os.path.isfile(tracker):
        return None
    with open(tracker, "rb") as f:
        text = f.read(64).decode("ascii", "replace").strip()
    if text == "release":
        return None if os.path.isdir(os.path.join(folder, "release")) else \
            f"{tracker}: names 'release', but {os.path.join(folder, 'release')} is missing"
    if not text.isdigit():
        return f"{tracker}: names no iteration ({text[:20]!r})"
    if not os.path.isdir(os.path.join(folder, f"iter_{int(text):07d}")):
        return f"{tracker}: names iteration {int(text)}, but " \
               f"{os.path.join(folder, f'iter_{int(text):07d}')} is missing"
    return None
