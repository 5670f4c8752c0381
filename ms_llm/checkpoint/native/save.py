"""Saving a distributed checkpoint: every rank writes only its own pieces, rank 0 publishes.

Two phases around a ``barrier()`` callable (the protocol in ``dcp``): ``write_rank_files`` on
every rank into a temporary folder, then ``finalize`` on rank 0, which validates all ranks' files,
writes ``metadata.json`` last and renames the folder into place, so a reader never sees a partial
checkpoint. ``save_checkpoint`` runs both and makes a failure on any rank raise on every rank.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import zlib
from typing import Callable, List, Mapping, Optional, Tuple

import numpy as np

from .format import (FAILED, FORMAT, METADATA, TRACKER, VERSION, DCPError, LocalChunk,
                     iter_dir, list_iters, read_json, volume)
from ..hf.io import _ST_NAMES

log = logging.getLogger("ms_llm.checkpoint")


def _dtype_name(dt: np.dtype, where: str) -> str:
    if np.dtype(dt) not in _ST_NAMES:
        raise DCPError(f"{where}: dtype {dt} cannot be stored in safetensors")
    return np.dtype(dt).name


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


def _tmp_dir(save_dir: str, step: int) -> str:
    return os.path.join(save_dir, f".tmp_iter_{step:07d}")


def _rank_name(rank: int) -> str:
    return f"rank_{rank:05d}"


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
        rec = read_json(jpath)
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
        have = sum(volume(c["sizes"]) for c in t["chunks"])
        if have != volume(t["global_shape"]):
            raise DCPError(f"tensor {name!r}: the ranks' pieces cover {have} of "
                           f"{volume(t['global_shape'])} elements (a piece nobody wrote?)")
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
    final = iter_dir(save_dir, step)
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


def _prune(save_dir: str, keep_last: int, protect: int) -> None:
    """Delete complete checkpoints beyond the newest ``keep_last`` (never ``protect``).
    Renamed away before removal so a half-deleted folder never looks like a checkpoint."""
    if keep_last < 1:
        raise DCPError(f"keep_last must be >= 1, got {keep_last}")
    done = [(s, p) for s, p in list_iters(save_dir)
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
    final = iter_dir(save_dir, step)
    if not os.path.isfile(os.path.join(final, METADATA)):
        raise DCPError(f"{final}: rank 0 did not publish the checkpoint")
    return final
