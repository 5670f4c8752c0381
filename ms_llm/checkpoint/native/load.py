"""Loading from a distributed checkpoint: any region of any tensor, from whatever pieces hold it.

The next run may use a different world size or layout (fsdp=3 -> fsdp=2, tp=2), so a reader asks
for a hyper-rectangle and gets it assembled from every stored piece that overlaps it. Tensors are
read slice by slice (``safe_open(...).get_slice``), so a rank reads only the rows it wants, and
only from a complete checkpoint.
"""
from __future__ import annotations

import os
from typing import Dict, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np

from .discovery import check_complete
from .format import METADATA, DCPError, WantedChunk, read_json, stored_dtype, volume
from ..verify import verify_file


class DCPReader:
    """A complete checkpoint opened for region reads (files are opened on first use).

    ``verify="crc"`` (default): structure and sizes are checked up front, and each file's crc32
    when it is first opened, so a rank pays one extra read of only the files it reads."""

    def __init__(self, path: str, verify: str = "crc"):
        reason = check_complete(path, "size" if verify == "crc" else verify)
        if reason:
            raise DCPError(f"{path}: refusing to load an incomplete checkpoint ({reason})")
        self.path = path
        self.meta = read_json(os.path.join(path, METADATA))
        self.tensors: Dict[str, dict] = self.meta["tensors"]
        self.state: dict = self.meta.get("state", {})
        self.step: int = self.meta.get("step")
        self._open: Dict[str, object] = {}
        self._verify = verify

    def names(self) -> List[str]:
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self._entry(name)["global_shape"])

    def dtype(self, name: str) -> np.dtype:
        return stored_dtype(self._entry(name)["dtype"])

    def _entry(self, name: str) -> dict:
        if name not in self.tensors:
            raise DCPError(f"{self.path}: tensor {name!r} is not in the checkpoint")
        return self.tensors[name]

    def _file(self, fname: str):
        if fname not in self._open:
            from safetensors import safe_open
            if self._verify == "crc":
                why = verify_file(os.path.join(self.path, fname), self.meta["files"][fname])
                if why:
                    raise DCPError(f"{self.path}: refusing to load a corrupt checkpoint ({why})")
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
        stored = stored_dtype(e["dtype"])
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
            covered += volume([h - l for l, h in zip(lo, hi)])
        if covered != volume(sz):
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
                    verify: str = "crc", requested_anywhere: Optional[Set[str]] = None
                    ) -> Tuple[Dict[str, np.ndarray], dict]:
    """Read each wanted region from a complete checkpoint: ``(arrays, state)``.

    Errors (one line naming the tensor and path) when a name is missing, the global shape
    differs or a region is not covered. ``strict`` also rejects checkpoint tensors nobody asked
    for -- e.g. optimizer moments the caller forgot to create, which would otherwise be
    silently dropped; pass ``strict=False`` for a deliberate partial load (weights only). With
    ranks that each load part of the model, pass the union of every rank's names as
    ``requested_anywhere``."""
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
            # a pipeline stage or an expert-parallel rank asks for part of the model: what
            # counts is that some rank asks for every stored tensor (``requested_anywhere``)
            asked = wanted if requested_anywhere is None else requested_anywhere
            extra = sorted(n for n in r.names() if n not in asked)
            if extra:
                raise DCPError(f"{path}: {len(extra)} stored tensor(s) were not requested, e.g. "
                               f"{extra[:3]} (create optimizer state before loading, or pass "
                               f"strict=False)")
        return out, r.state
