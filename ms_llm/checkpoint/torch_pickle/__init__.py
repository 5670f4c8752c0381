"""Read and write PyTorch ``torch.save`` zip checkpoints without importing torch.

Why: Megatron / MindSpeed-LLM checkpoints (``model_optim_rng.pt``) are ``torch.save`` files, and
ms-llm must read and write them on machines without torch. The format is a zip archive (stored,
not compressed) of ``<prefix>/data.pkl`` -- a pickle in which every tensor is
``torch._utils._rebuild_tensor_v2(<persistent storage id>, offset, size, stride, ...)`` -- and
``<prefix>/data/<key>``, the raw little-endian bytes of each storage.

Reading (``reader``, ``archive``) uses a *restricted* pure-Python
unpickler: only the globals a checkpoint needs resolve, ``BUILD`` works only on the containers a
checkpoint holds, and every size is checked against the file before anything is allocated;
anything else raises ``TorchFormatError`` (``ForbiddenGlobalError`` for a refused global) before
any code runs. Tensors come back as ``LazyTensor`` (bytes read on ``.numpy()``) or as NumPy arrays.

Writing emits the same opcodes ``torch.save`` does (pickle protocol 2 by default, like
``torch.save``), storages aligned to 64 bytes, plus the ``.format_version``,
``.storage_alignment``, ``byteorder``, ``version`` and ``.data/serialization_id`` records, so the
files load with ``torch.load(path, weights_only=True)`` (``argparse.Namespace`` values need
``torch.serialization.safe_globals([argparse.Namespace])``, exactly as for Megatron's own files).
``TorchZipWriter`` streams storages to disk as they are added and writes ``data.pkl`` last, so a
checkpoint never has to be held in memory whole.
"""
from __future__ import annotations

import argparse
import collections
import io
import os
import pickle
import struct
import sys
import zipfile
import zlib
from typing import Dict, Iterable, Optional

import numpy as np

from .archive import LazyTensor
from .format import (STORAGE_BY_DTYPE, STORAGE_DTYPES, ForbiddenGlobalError,
                     GlobalCall, GlobalRef, TorchFormatError, contiguous_strides,
                     torch_dtype)
from .reader import TorchCheckpoint, load

__all__ = ["load", "save", "LazyTensor", "TorchCheckpoint", "TorchZipWriter", "GlobalRef",
           "GlobalCall", "torch_dtype", "ForbiddenGlobalError", "TorchFormatError",
           "STORAGE_DTYPES"]


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------

_ALIGN = 64
_OD = collections.OrderedDict


class _StorageRef:
    def __init__(self, key: str, dtype: np.dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class TensorRef:
    """Placeholder in the pickled object tree for a tensor stored by ``TorchZipWriter``."""

    def __init__(self, storage: _StorageRef, shape: tuple, offset: int = 0,
                 stride: Optional[tuple] = None):
        self.storage, self.shape, self.offset = storage, tuple(shape), offset
        self.stride = tuple(stride) if stride is not None else contiguous_strides(self.shape)


class _TorchPickler(pickle._Pickler):
    """Pure-Python pickler (the C one would import ``torch`` to check globals) that emits the
    same opcodes as ``torch.save``'s pickler."""

    dispatch = dict(pickle._Pickler.dispatch)

    def __init__(self, file, protocol: int):
        super().__init__(file, protocol=protocol)
        self._storage_pid: Dict[int, tuple] = {}

    def persistent_id(self, obj):
        if isinstance(obj, _StorageRef):
            return ("storage", GlobalRef("torch", STORAGE_BY_DTYPE[obj.dtype]), obj.key, "cpu",
                    obj.numel)
        return None

    def reducer_override(self, obj):
        if isinstance(obj, TensorRef):
            return (GlobalRef("torch._utils", "_rebuild_tensor_v2"),
                    (obj.storage, obj.offset, obj.shape, obj.stride, False, _OD()))
        if isinstance(obj, GlobalCall):
            return (obj.ref, obj.args)
        return NotImplemented

    def save_globalref(self, obj: GlobalRef) -> None:
        if self.proto >= 4:
            self.save(obj.module)
            self.save(obj.name)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + obj.module.encode("utf-8") + b"\n" +
                       obj.name.encode("utf-8") + b"\n")
        self.memoize(obj)

    dispatch[GlobalRef] = save_globalref


class TorchZipWriter:
    """Stream a torch checkpoint: ``add_tensor`` writes each storage at once (64-byte aligned);
    ``close(obj)`` pickles ``obj`` (with the returned ``TensorRef`` leaves) as ``data.pkl``.

    Writes go to ``path`` directly; callers make the whole output folder atomic.
    """

    def __init__(self, path: str, archive_name: Optional[str] = None, protocol: int = 2):
        # torch.save names the archive folder after the file (``model_optim_rng/data.pkl``)
        archive_name = archive_name or os.path.splitext(os.path.basename(path))[0] or "archive"
        self.path, self.prefix, self.protocol = path, archive_name + "/", protocol
        self.zf = zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True)
        self._n = 0
        self._records: list = []

    def _write_record(self, name: str, chunks: Iterable, nbytes: int, align: bool) -> None:
        info = zipfile.ZipInfo(self.prefix + name, date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_STORED
        info.file_size = nbytes
        zip64 = nbytes * 1.05 > zipfile.ZIP64_LIMIT  # zipfile's own rule in _open_to_write
        if align:
            offset = self.zf.fp.tell()
            info.extra, info.CRC, info.compress_size = b"", 0, 0
            head = len(info.FileHeader(zip64))
            pad = (-(offset + head + 4)) % _ALIGN
            info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # torch's 'FB' padding
        with self.zf.open(info, "w", force_zip64=zip64) as f:
            for c in chunks:
                f.write(c)

    def add_tensor(self, array: np.ndarray) -> TensorRef:
        arr = np.ascontiguousarray(array)
        if arr.dtype not in STORAGE_BY_DTYPE:
            raise TypeError(f"{self.path}: dtype {arr.dtype} has no torch storage type")
        if sys.byteorder != "little":  # pragma: no cover
            arr = arr.byteswap()
        key = str(self._n)
        self._n += 1
        data = memoryview(arr.reshape(-1).view(np.uint8))
        step = 1 << 26
        self._write_record(f"data/{key}", (data[i:i + step] for i in range(0, arr.nbytes, step)),
                           arr.nbytes, align=True)
        return TensorRef(_StorageRef(key, arr.dtype, arr.size), arr.shape)

    def close(self, obj) -> None:
        buf = io.BytesIO()
        _TorchPickler(buf, self.protocol).dump(obj)
        pkl = buf.getvalue()
        self._write_record("data.pkl", [pkl], len(pkl), align=True)
        for name, value in ((".format_version", b"1"), (".storage_alignment", b"64"),
                            ("byteorder", b"little"), ("version", b"3\n"),
                            (".data/serialization_id", _serialization_id(pkl))):
            self._write_record(name, [value], len(value), align=True)
        self.zf.close()

    def abort(self) -> None:
        try:
            self.zf.close()
        except Exception:  # noqa: BLE001  (already failing; the caller removes the file)
            pass


def _serialization_id(pkl: bytes) -> bytes:
    # torch writes 40 decimal digits; a content hash keeps our files reproducible.
    return str(int.from_bytes(zlib.crc32(pkl).to_bytes(4, "little") * 5, "little")).rjust(
        40, "0")[:40].encode()


def _to_refs(obj, writer: TorchZipWriter):
    if isinstance(obj, np.ndarray):
        return writer.add_tensor(obj)
    if isinstance(obj, LazyTensor):
        return writer.add_tensor(obj.numpy())
    if isinstance(obj, collections.OrderedDict):
        return collections.OrderedDict((k, _to_refs(v, writer)) for k, v in obj.items())
    if isinstance(obj, dict):
        return {k: _to_refs(v, writer) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_refs(v, writer) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_refs(v, writer) for v in obj)
    if isinstance(obj, argparse.Namespace):
        return argparse.Namespace(**{k: _to_refs(v, writer) for k, v in vars(obj).items()})
    return obj


def save(obj, path: str, protocol: int = 2) -> None:
    """``torch.save(obj, path)`` without torch: NumPy arrays become tensors; other leaves must be
    picklable plain data (None, numbers, str, containers, Namespace, ``torch_dtype(...)``)."""
    writer = TorchZipWriter(path, protocol=protocol)
    try:
        refs = _to_refs(obj, writer)
        writer.close(refs)
    except BaseException:
        writer.abort()
        raise


def dump_records(obj, file, protocol: int = 2) -> None:
    """Pickle plain data and ``GlobalRef`` / ``GlobalCall`` records (no tensors) to ``file``,
    e.g. a torch DCP ``.metadata`` (``torch_dist``), which torch reads with ``pickle.load``."""
    _TorchPickler(file, protocol=protocol).dump(obj)
