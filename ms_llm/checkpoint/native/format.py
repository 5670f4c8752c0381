"""The distributed checkpoint's on-disk format, shared by saving, discovery, loading and export.

Everything ``save``, ``discovery``, ``load`` and ``export`` must agree on lives
here and imports nothing of theirs: the file and folder names, the error type, the piece
descriptions (``LocalChunk`` to write, ``WantedChunk`` to read back), the sharding rules that
produce them, and the JSON / dtype helpers. The layout itself is described in ``dcp``.
"""
from __future__ import annotations

import json
import os
import re
import zlib
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy before safetensors needs it)
import numpy as np

TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
FORMAT = "ms_llm.dcp"
VERSION = 1
FAILED = "FAILED"
_ITER_RE = re.compile(r"iter_(\d{7,})")


class DCPError(ValueError):
    """A checkpoint that cannot be written or loaded as asked (message names path and tensor)."""


@dataclass
class LocalChunk:
    """This rank's piece of a tensor: ``data`` sits at ``offsets`` inside ``global_shape``.

    ``write=False`` declares the tensor without writing it (replicated tensors: exactly one
    rank writes them; the others still declare them so a missing writer is detected)."""

    data: np.ndarray
    global_shape: Sequence[int]
    offsets: Optional[Sequence[int]] = None
    write: bool = True


@dataclass
class WantedChunk:
    """The region a rank wants back: ``sizes`` rows/cols starting at ``offsets``; ``dtype``
    None keeps the stored dtype, otherwise the stored values are cast."""

    global_shape: Sequence[int]
    offsets: Sequence[int]
    sizes: Sequence[int]
    dtype: Optional[object] = None


def dim0_chunk(global_shape: Sequence[int], rank: int, world_size: int
               ) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """FSDP's ``torch.chunk`` rule on dim 0: ``C = ceil(D0 / W)``, rank r holds rows
    ``[r*C, min((r+1)*C, D0))`` (possibly none). Returns ``(offsets, sizes)``."""
    shape = tuple(int(s) for s in global_shape)
    if not shape:
        raise DCPError("dim0_chunk: a 0-d tensor cannot be sharded on dim 0")
    c = -(-shape[0] // world_size) if world_size > 0 else 0
    lo = min(rank * c, shape[0])
    hi = min(lo + c, shape[0])
    return (lo,) + (0,) * (len(shape) - 1), (hi - lo,) + shape[1:]


def block_chunk(global_shape: Sequence[int], dim: int, rank: int, world_size: int
                ) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """Tensor parallel's even split of ``dim`` into ``world_size`` blocks."""
    shape = list(int(s) for s in global_shape)
    if shape[dim] % world_size:
        raise DCPError(f"block_chunk: dim {dim} of {tuple(shape)} is not divisible by "
                       f"{world_size}")
    n = shape[dim] // world_size
    offsets = [0] * len(shape)
    offsets[dim] = rank * n
    shape[dim] = n
    return tuple(offsets), tuple(shape)


def stored_dtype(name: str) -> np.dtype:
    """The NumPy dtype recorded as ``name`` (bfloat16 comes from ml_dtypes, not NumPy)."""
    return np.dtype(getattr(ml_dtypes, name)) if name in ("bfloat16",) else np.dtype(name)


def volume(sizes: Sequence[int]) -> int:
    """Element count of a region (1 for a 0-d tensor)."""
    return int(np.prod(sizes, dtype=np.int64)) if len(sizes) else 1


def read_json(path: str) -> dict:
    """A JSON object from ``path``; malformed content is a ``DCPError`` naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except json.JSONDecodeError as e:
        raise DCPError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise DCPError(f"{path}: expected a JSON object")
    return obj


def file_crc32(path: str) -> int:
    """crc32 of a whole file, read in 16 MiB blocks (what ``verify="crc"`` compares)."""
    crc = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(1 << 24)
            if not block:
                return crc
            crc = zlib.crc32(block, crc)


def iter_dir(save_dir: str, step: int) -> str:
    """Megatron's folder name for step ``step``: ``iter_0000010``."""
    return os.path.join(save_dir, f"iter_{step:07d}")


def list_iters(save_dir: str) -> List[Tuple[int, str]]:
    """``(step, path)`` of every ``iter_*`` folder, oldest first, complete or not."""
    if not os.path.isdir(save_dir):
        return []
    out = []
    for n in os.listdir(save_dir):
        m = _ITER_RE.fullmatch(n)
        if m and os.path.isdir(os.path.join(save_dir, n)):
            out.append((int(m.group(1)), os.path.join(save_dir, n)))
    return sorted(out)
