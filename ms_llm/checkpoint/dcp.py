"""Distributed, reshardable training checkpoints (issue 5): every rank writes only its own rows.

Why this layout: with FSDP a rank never holds a whole tensor, and the next run may use a
different world size (fsdp=3 -> fsdp=2, fsdp=1, tp=2). So each rank writes its *pieces* and the
metadata records, per tensor, the global shape and where every piece sits; a loader asks for any
hyper-rectangle and gets it assembled from whatever pieces overlap it.

Layout (Megatron's tracker and folder names, so existing tooling finds the newest iteration)::

    <save_dir>/latest_checkpointed_iteration.txt     "10", written atomically after a complete save
    <save_dir>/iter_0000010/rank_00000.safetensors   rank 0's real rows (no padding/empty pieces)
    <save_dir>/iter_0000010/rank_00000.json          rank 0's chunk list + file size + crc32
    <save_dir>/iter_0000010/metadata.json            written LAST: its presence marks completeness

Protocol (the only collective is a ``barrier()`` callable): all ranks ``write_rank_files`` into
``<save_dir>/.tmp_iter_0000010``; ``barrier()``; rank 0 ``finalize``s (validates every rank's
files, checks the chunks tile each tensor exactly, writes ``metadata.json``, fsyncs, renames the
folder to ``iter_0000010``, updates the tracker, prunes to ``keep_last``); ``barrier()``; every
rank then checks the outcome, so a failed finalisation raises on all ranks instead of hanging.

Loading (``load_checkpoint``) never touches a checkpoint whose metadata is missing or whose files
do not have their recorded sizes; ``find_latest_complete`` falls back past such checkpoints and
says so. Tensors are read slice by slice (``safe_open(...).get_slice``), so a rank reads only the
rows it wants. Export to Hugging Face / Megatron folders lives in ``dcp_export``.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import struct
import zlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy before safetensors needs it)
import numpy as np

from .hf_io import _ST_NAMES

log = logging.getLogger("ms_llm.checkpoint")

TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
FORMAT = "ms_llm.dcp"
VERSION = 1
FAILED = "FAILED"
_ITER_RE = re.compile(r"iter_(\d{7,})")

__all__ = ["LocalChunk", "WantedChunk", "DCPError", "save_checkpoint", "write_rank_files",
           "finalize", "load_checkpoint", "DCPReader", "find_latest_complete", "check_complete",
           "resolve_resume", "read_state", "dim0_chunk", "block_chunk", "export_hf",
           "export_megatron"]


class DCPError(ValueError):
    """A checkpoint that cannot be written or loaded as asked (message names path and tensor)."""


# --------------------------------------------------------------------------------------------
# Pieces
# --------------------------------------------------------------------------------------------

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


def _dtype_name(dt: np.dtype, where: str) -> str:
    if np.dtype(dt) not in _ST_NAMES:
        raise DCPError(f"{where}: dtype {dt} cannot be stored in safetensors")
    return np.dtype(dt).name


def _dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name)) if name in ("bfloat16",) else np.dtype(name)


def _check_chunk(name: str, c: LocalChunk) -> Tuple[np.ndarray, tuple, tuple, tuple]:
    data = np.asarray(c.data)
    g = tuple(int(s) for s in c.global_shape)
    off = tuple(int(o) for o in (c.offsets if c.offsets is not None else (0,) * len(g)))
    if data.ndim != len(g) or len(off) != len(g):
        raise DCPError(f"tensor {name!r}: data has {data.ndim} dims, global_shape {list(g)} and "
                       f"offsets {list(off)} must match it")
    for d, (o, s, n) in enumerate(zip(off, data.shape, g)):
        if o < 0 or o + s > n:
            raise DCPError(f"tensor {name!r}: piece rows [{o}, {o + s}) on dim {d} lie outside "
                           f"global shape {list(g)}")
    return data, g, off, tuple(data.shape)


# --------------------------------------------------------------------------------------------
# Small file helpers
# --------------------------------------------------------------------------------------------

def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json_atomic(path: str, obj) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except json.JSONDecodeError as e:
        raise DCPError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise DCPError(f"{path}: expected a JSON object")
    return obj


def _write_safetensors(path: str, tensors: List[Tuple[str, np.ndarray]]) -> Tuple[int, int]:
    """Stream tensors into a safetensors file (no whole-file bytes copy) and return
    ``(size, crc32)`` of what was written; crc32 is what ``verify="crc"`` re-checks."""
    header, off = {"__metadata__": {"format": FORMAT}}, 0
    for name, a in tensors:
        header[name] = {"dtype": _ST_NAMES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * ((-len(blob)) % 8)
    head = struct.pack("<Q", len(blob)) + blob
    crc = zlib.crc32(head)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(head)
        for _, a in tensors:
            view = memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
            f.write(view)
            crc = zlib.crc32(view, crc)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(head) + off, crc


def _file_crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(1 << 24)
            if not block:
                return crc
            crc = zlib.crc32(block, crc)


def _iter_dir(save_dir: str, step: int) -> str:
    return os.path.join(save_dir, f"iter_{step:07d}")


def _tmp_dir(save_dir: str, step: int) -> str:
    return os.path.join(save_dir, f".tmp_iter_{step:07d}")


def _rank_name(rank: int) -> str:
    return f"rank_{rank:05d}"


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------

def write_rank_files(save_dir: str, step: int, local: Mapping[str, LocalChunk], *, rank: int,
                     world_size: int) -> str:
    """Phase 1 (every rank): write this rank's real rows and its chunk list into the temp folder.

    Empty pieces (an FSDP rank with 0 rows) and ``write=False`` pieces are declared in the json
    but store no data. Returns the temp folder."""
    if not 0 <= rank < world_size:
        raise DCPError(f"save_checkpoint: rank {rank} outside world size {world_size}")
    tmp = _tmp_dir(save_dir, step)
    os.makedirs(tmp, exist_ok=True)
    base = _rank_name(rank)
    try:  # a stale json of an interrupted attempt must not stand in for this one
        os.remove(os.path.join(tmp, base + ".json"))
    except FileNotFoundError:
        pass
    if rank == 0:  # nobody reads FAILED before the second barrier of this save
        try:
            os.remove(os.path.join(tmp, FAILED))
        except FileNotFoundError:
            pass
    entries, stored = {}, []
    for name, chunk in local.items():
        data, g, off, sizes = _check_chunk(name, chunk)
        dname = _dtype_name(data.dtype, f"tensor {name!r}")
        written = bool(chunk.write) and data.size > 0
        entries[name] = {"dtype": dname, "global_shape": list(g), "offsets": list(off),
                         "sizes": list(sizes), "stored": written}
        if written:
            stored.append((name, data))
    rec = {"format": FORMAT, "rank": rank, "world_size": world_size, "step": step,
           "file": None, "size": 0, "crc32": 0, "tensors": entries}
    if stored:
        size, crc = _write_safetensors(os.path.join(tmp, base + ".safetensors"), stored)
        rec.update(file=base + ".safetensors", size=size, crc32=crc)
    _write_json_atomic(os.path.join(tmp, base + ".json"), rec)
    return tmp


def _volume(sizes: Sequence[int]) -> int:
    return int(np.prod(sizes, dtype=np.int64)) if len(sizes) else 1


def _overlap(a_off, a_sz, b_off, b_sz) -> bool:
    return all(max(ao, bo) < min(ao + az, bo + bz)
               for ao, az, bo, bz in zip(a_off, a_sz, b_off, b_sz))


def _check_disjoint(name: str, t: dict) -> None:
    """No two pieces of a tensor overlap. Row pieces (FSDP: full extent on dims 1..) are
    checked in O(k log k) after sorting; other layouts pairwise."""
    chunks, g = t["chunks"], t["global_shape"]
    bad = None
    if all(c["sizes"][1:] == g[1:] for c in chunks) and g:
        rows = sorted(chunks, key=lambda c: c["offsets"][0])
        bad = next(((a, b) for a, b in zip(rows, rows[1:])
                    if b["offsets"][0] < a["offsets"][0] + a["sizes"][0]), None)
    else:
        bad = next(((a, b) for i, a in enumerate(chunks) for b in chunks[i + 1:]
                    if _overlap(a["offsets"], a["sizes"], b["offsets"], b["sizes"])), None)
    if bad:
        raise DCPError(f"tensor {name!r}: the piece at {bad[1]['offsets']} in {bad[1]['file']} "
                       f"overlaps the one in {bad[0]['file']} (a replicated tensor must be "
                       f"written by one rank: LocalChunk.write=False)")


def _build_metadata(tmp: str, step: int, world_size: int) -> Tuple[dict, dict]:
    """Read and cross-check all rank json files: returns ``(files, tensors)`` for metadata."""
    files, tensors = {}, {}
    for r in range(world_size):
        jpath = os.path.join(tmp, _rank_name(r) + ".json")
        if not os.path.isfile(jpath):
            raise DCPError(f"{jpath}: missing (rank {r} did not finish writing)")
        rec = _read_json(jpath)
        if rec.get("step") != step or rec.get("world_size") != world_size:
            raise DCPError(f"{jpath}: written for step {rec.get('step')} / world size "
                           f"{rec.get('world_size')}, expected {step} / {world_size}")
        if rec["file"]:
            fpath = os.path.join(tmp, rec["file"])
            have = os.path.getsize(fpath) if os.path.isfile(fpath) else None
            if have != rec["size"]:
                raise DCPError(f"{fpath}: {'missing' if have is None else f'{have} bytes'}, "
                               f"rank {r} recorded {rec['size']}")
            files[rec["file"]] = {"size": rec["size"], "crc32": rec["crc32"], "rank": r}
        for name, e in rec["tensors"].items():
            t = tensors.setdefault(name, {"dtype": e["dtype"], "global_shape": e["global_shape"],
                                          "chunks": []})
            if (t["dtype"], t["global_shape"]) != (e["dtype"], e["global_shape"]):
                raise DCPError(f"tensor {name!r}: rank {r} has {e['dtype']}{e['global_shape']}, "
                               f"another rank {t['dtype']}{t['global_shape']}")
            if e["stored"]:
                t["chunks"].append({"file": rec["file"], "key": name, "offsets": e["offsets"],
                                    "sizes": e["sizes"]})
    for name, t in tensors.items():
        _check_disjoint(name, t)
        have = sum(_volume(c["sizes"]) for c in t["chunks"])
        if have != _volume(t["global_shape"]):
            raise DCPError(f"tensor {name!r}: the ranks' pieces cover {have} of "
                           f"{_volume(t['global_shape'])} elements (a piece nobody wrote?)")
    return files, tensors


def finalize(save_dir: str, step: int, state: Optional[dict], *, world_size: int,
             keep_last: Optional[int] = None, mesh: Optional[dict] = None) -> str:
    """Phase 2 (rank 0, after every rank's ``write_rank_files``): validate, write metadata last,
    publish the folder, update the tracker, prune. Returns the ``iter_*`` path."""
    tmp = _tmp_dir(save_dir, step)
    files, tensors = _build_metadata(tmp, step, world_size)
    try:
        state_obj = json.loads(json.dumps(state or {}))
    except (TypeError, ValueError) as e:
        raise DCPError(f"save_checkpoint: state is not JSON-serialisable ({e})") from None
    keep = {METADATA} | set(files) | {_rank_name(r) + ".json" for r in range(world_size)}
    for n in os.listdir(tmp):  # stale files of an earlier, interrupted attempt
        if n not in keep:
            p = os.path.join(tmp, n)
            shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
    meta = {"format": FORMAT, "version": VERSION, "step": step, "world_size": world_size,
            "mesh": mesh or {}, "files": files, "tensors": tensors, "state": state_obj}
    _write_json_atomic(os.path.join(tmp, METADATA), meta)
    _fsync_dir(tmp)
    final = _iter_dir(save_dir, step)
    old = None
    if os.path.exists(final):  # re-saving a step (e.g. after resuming from an earlier one)
        old = os.path.join(save_dir, f".old_iter_{step:07d}_{os.getpid()}")
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(save_dir)
    tracker_tmp = os.path.join(save_dir, f".{TRACKER}.tmp-{os.getpid()}")
    with open(tracker_tmp, "w", encoding="utf-8") as f:
        f.write(str(step))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tracker_tmp, os.path.join(save_dir, TRACKER))
    _fsync_dir(save_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if keep_last is not None:
        _prune(save_dir, keep_last, protect=step)
    return final


def _list_iters(save_dir: str) -> List[Tuple[int, str]]:
    if not os.path.isdir(save_dir):
        return []
    out = []
    for n in os.listdir(save_dir):
        m = _ITER_RE.fullmatch(n)
        if m and os.path.isdir(os.path.join(save_dir, n)):
            out.append((int(m.group(1)), os.path.join(save_dir, n)))
    return sorted(out)


def _prune(save_dir: str, keep_last: int, protect: int) -> None:
    """Delete complete checkpoints beyond the newest ``keep_last`` (never ``protect``).
    Renamed away before removal so a half-deleted folder never looks like a checkpoint."""
    if keep_last < 1:
        raise DCPError(f"keep_last must be >= 1, got {keep_last}")
    done = [(s, p) for s, p in _list_iters(save_dir)
            if os.path.isfile(os.path.join(p, METADATA))]
    for s, p in done[:-keep_last] if len(done) > keep_last else []:
        if s == protect:
            continue
        trash = os.path.join(save_dir, f".trash_iter_{s:07d}_{os.getpid()}")
        os.rename(p, trash)
        shutil.rmtree(trash, ignore_errors=True)
        log.info("pruned checkpoint %s (keep_last=%d)", p, keep_last)


def save_checkpoint(save_dir: str, step: int, local: Mapping[str, LocalChunk],
                    state: Optional[dict] = None, *, rank: int, world_size: int,
                    barrier: Callable[[], None], keep_last: Optional[int] = None,
                    mesh: Optional[dict] = None) -> str:
    """Save this rank's pieces; collective (every rank calls it with the same ``step``).

    ``state`` (rank 0's is stored): step, LR schedule, data position, RNG... anything JSON-able.
    Optimizer moments go in ``local`` as more pieces (``optimizer.exp_avg.<param>``).
    Returns the published ``iter_*`` folder on every rank, or raises on every rank."""
    err = None
    try:
        write_rank_files(save_dir, step, local, rank=rank, world_size=world_size)
    except Exception as e:  # still reach the barriers: the others must not hang
        err = e
    barrier()
    if rank == 0:
        try:
            finalize(save_dir, step, state, world_size=world_size, keep_last=keep_last,
                     mesh=mesh)
        except Exception as e:
            err = err or e
            tmp = _tmp_dir(save_dir, step)
            os.makedirs(tmp, exist_ok=True)
            with open(os.path.join(tmp, FAILED), "w", encoding="utf-8") as f:
                f.write(" ".join(str(e).split()))
    barrier()
    if err is not None:
        raise err
    failed = os.path.join(_tmp_dir(save_dir, step), FAILED)
    if os.path.isfile(failed):
        with open(failed, encoding="utf-8") as f:
            raise DCPError(f"checkpoint {step} was not saved (rank 0: {f.read().strip()})")
    final = _iter_dir(save_dir, step)
    if not os.path.isfile(os.path.join(final, METADATA)):
        raise DCPError(f"{final}: rank 0 did not publish the checkpoint")
    return final


# --------------------------------------------------------------------------------------------
# Completeness and discovery
# --------------------------------------------------------------------------------------------

def check_complete(path: str, verify: str = "size") -> Optional[str]:
    """``None`` if ``path`` is a complete checkpoint, else the reason it is not.

    ``verify``: ``"size"`` (metadata present, every file with its recorded size and a readable
    header) or ``"crc"`` (also re-reads every file and compares its crc32)."""
    if verify not in ("size", "crc"):
        raise DCPError(f"verify: expected 'size' or 'crc', got {verify!r}")
    mpath = os.path.join(path, METADATA)
    if not os.path.isfile(mpath):
        return f"{mpath} is missing (save did not finish)"
    try:
        meta = _read_json(mpath)
    except DCPError as e:
        return str(e)
    if meta.get("format") != FORMAT:
        return f"{mpath}: not an {FORMAT} checkpoint"
    for name, f in meta.get("files", {}).items():
        fpath = os.path.join(path, name)
        if not os.path.isfile(fpath):
            return f"{fpath} is missing"
        have = os.path.getsize(fpath)
        if have != f["size"]:
            return f"{fpath} has {have} bytes, metadata records {f['size']} (truncated?)"
        if verify == "crc" and _file_crc32(fpath) != f["crc32"]:
            return f"{fpath}: crc32 differs from the metadata (corrupt)"
    return None


def read_state(path: str) -> dict:
    """The ``state`` dict saved with a complete checkpoint."""
    reason = check_complete(path)
    if reason:
        raise DCPError(f"{path}: not a complete checkpoint ({reason})")
    return _read_json(os.path.join(path, METADATA))["state"]


def find_latest_complete(save_dir: Optional[str], verify: str = "size",
                         report: Optional[Callable[[str], None]] = None) -> Optional[str]:
    """The newest complete ``iter_*`` in ``save_dir`` (None if there is none).

    Newer incomplete checkpoints (metadata missing, a shard truncated) are skipped and reported
    through ``report`` (default: a log warning), including when the tracker names one of them."""
    say = report or log.warning
    if not save_dir or not os.path.isdir(save_dir):
        return None
    tracker, tracked = os.path.join(save_dir, TRACKER), None
    if os.path.isfile(tracker):
        with open(tracker, encoding="utf-8") as f:
            text = f.read().strip()
        tracked = int(text) if text.isdigit() else None
        if tracked is None:
            say(f"{tracker}: ignoring unreadable content {text!r}")
    skipped = []
    for step, path in reversed(_list_iters(save_dir)):
        reason = check_complete(path, verify)
        if reason is None:
            if skipped:
                say(f"resume: skipping incomplete checkpoint(s) "
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
        return find_latest_complete(save_dir, report=report)
    path = str(resume)
    if os.path.isfile(os.path.join(path, TRACKER)) and not os.path.isfile(
            os.path.join(path, METADATA)):
        found = find_latest_complete(path, report=report)
        if found is None:
            raise DCPError(f"training.resume: {path} holds no complete checkpoint")
        return found
    reason = check_complete(path)
    if reason:
        raise DCPError(f"training.resume: {path} is not a complete checkpoint ({reason})")
    return path


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

class DCPReader:
    """A complete checkpoint opened for region reads (files are opened on first use)."""

    def __init__(self, path: str, verify: str = "size"):
        reason = check_complete(path, verify)
        if reason:
            raise DCPError(f"{path}: refusing to load an incomplete checkpoint ({reason})")
        self.path = path
        self.meta = _read_json(os.path.join(path, METADATA))
        self.tensors: Dict[str, dict] = self.meta["tensors"]
        self.state: dict = self.meta.get("state", {})
        self.step: int = self.meta.get("step")
        self._open: Dict[str, object] = {}

    def names(self) -> List[str]:
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self._entry(name)["global_shape"])

    def dtype(self, name: str) -> np.dtype:
        return _dtype(self._entry(name)["dtype"])

    def _entry(self, name: str) -> dict:
        if name not in self.tensors:
            raise DCPError(f"{self.path}: tensor {name!r} is not in the checkpoint")
        return self.tensors[name]

    def _file(self, fname: str):
        if fname not in self._open:
            from safetensors import safe_open
            try:
                self._open[fname] = safe_open(os.path.join(self.path, fname), framework="numpy")
            except Exception as e:  # safetensors raises its own error types
                raise DCPError(f"{os.path.join(self.path, fname)}: cannot read ({e})") from None
        return self._open[fname]

    def read(self, name: str, offsets: Optional[Sequence[int]] = None,
             sizes: Optional[Sequence[int]] = None, dtype=None) -> np.ndarray:
        """Assemble the region ``[offsets, offsets + sizes)`` (default: the whole tensor)
        from the stored pieces that intersect it, reading only the intersecting slices."""
        e = self._entry(name)
        g = tuple(e["global_shape"])
        off = tuple(int(o) for o in (offsets if offsets is not None else (0,) * len(g)))
        sz = tuple(int(s) for s in (sizes if sizes is not None else g))
        if len(off) != len(g) or len(sz) != len(g) or any(
                o < 0 or s < 0 or o + s > n for o, s, n in zip(off, sz, g)):
            raise DCPError(f"{self.path}: tensor {name!r}: region offsets {list(off)} sizes "
                           f"{list(sz)} is outside its global shape {list(g)}")
        stored = _dtype(e["dtype"])
        out = np.empty(sz, dtype=stored)
        covered = 0
        for c in e["chunks"]:
            lo = [max(o, co) for o, co in zip(off, c["offsets"])]
            hi = [min(o + s, co + cs) for o, s, co, cs in zip(off, sz, c["offsets"], c["sizes"])]
            if any(h <= l for l, h in zip(lo, hi)):
                continue
            src = tuple(slice(l - co, h - co) for l, h, co in zip(lo, hi, c["offsets"]))
            dst = tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, off))
            f = self._file(c["file"])
            part = np.asarray(f.get_slice(c["key"])[src] if src else f.get_tensor(c["key"]))
            if part.shape != tuple(h - l for l, h in zip(lo, hi)):
                raise DCPError(f"{os.path.join(self.path, c['file'])}: piece of {name!r} has "
                               f"shape {list(part.shape)}, metadata says {c['sizes']}")
            out[dst] = part
            covered += _volume([h - l for l, h in zip(lo, hi)])
        if covered != _volume(sz):
            raise DCPError(f"{self.path}: tensor {name!r}: region offsets {list(off)} sizes "
                           f"{list(sz)} is not fully covered by the stored pieces")
        if dtype is not None and np.dtype(dtype) != stored:
            out = out.astype(np.dtype(dtype))
        return out

    def close(self) -> None:
        self._open.clear()

    def __enter__(self) -> "DCPReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_checkpoint(path: str, wanted: Mapping[str, WantedChunk], *, strict: bool = True,
                    verify: str = "size") -> Tuple[Dict[str, np.ndarray], dict]:
    """Read each wanted region from a complete checkpoint: ``(arrays, state)``.

    Errors (one line naming the tensor and path) when a name is missing, the global shape
    differs or a region is not covered. ``strict`` also rejects checkpoint tensors nobody asked
    for -- e.g. optimizer moments the caller forgot to create, which would otherwise be
    silently dropped; pass ``strict=False`` for a deliberate partial load (weights only)."""
    with DCPReader(path, verify) as r:
        out = {}
        for name, w in wanted.items():
            if name not in r:
                raise DCPError(f"{path}: tensor {name!r} is not in the checkpoint")
            if tuple(int(s) for s in w.global_shape) != r.shape(name):
                raise DCPError(f"{path}: tensor {name!r} has global shape {list(r.shape(name))}, "
                               f"the model wants {list(w.global_shape)}")
            out[name] = r.read(name, w.offsets, w.sizes, w.dtype)
        if strict:
            extra = sorted(n for n in r.names() if n not in wanted)
            if extra:
                raise DCPError(f"{path}: {len(extra)} stored tensor(s) were not requested, e.g. "
                               f"{extra[:3]} (create optimizer state before loading, or pass "
                               f"strict=False)")
        return out, r.state


def __getattr__(name):
    if name in ("export_hf", "export_megatron"):
        from . import dcp_export
        return getattr(dcp_export, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
