"""Read and write PyTorch ``torch.save`` zip checkpoints without importing torch.

Why: Megatron / MindSpeed-LLM checkpoints (``model_optim_rng.pt``) are ``torch.save`` files, and
ms-llm must read and write them on machines without torch. The format is a zip archive (stored,
not compressed) of ``<prefix>/data.pkl`` -- a pickle in which every tensor is
``torch._utils._rebuild_tensor_v2(<persistent storage id>, offset, size, stride, ...)`` -- and
``<prefix>/data/<key>``, the raw little-endian bytes of each storage.

Reading uses a *restricted* unpickler: only the globals a checkpoint needs resolve (tensor
rebuild functions, storage types, torch dtypes, ``OrderedDict``, ``argparse.Namespace``, a few
Megatron enums, NumPy array reconstruction); anything else raises ``ForbiddenGlobalError`` before
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
from typing import Any, Dict, Iterable, Optional, Tuple

import ml_dtypes
import numpy as np

__all__ = ["load", "save", "LazyTensor", "TorchZipWriter", "GlobalRef", "torch_dtype",
           "ForbiddenGlobalError", "TorchFormatError", "STORAGE_DTYPES"]


class TorchFormatError(ValueError):
    """The file is not a readable torch zip checkpoint (truncated, legacy format, bad record)."""


class ForbiddenGlobalError(pickle.UnpicklingError):
    """The pickle asks for a global outside the allow-list (never imported or executed)."""


# torch storage class name -> NumPy dtype
STORAGE_DTYPES: Dict[str, np.dtype] = {
    "DoubleStorage": np.dtype(np.float64),
    "FloatStorage": np.dtype(np.float32),
    "HalfStorage": np.dtype(np.float16),
    "BFloat16Storage": np.dtype(ml_dtypes.bfloat16),
    "LongStorage": np.dtype(np.int64),
    "IntStorage": np.dtype(np.int32),
    "ShortStorage": np.dtype(np.int16),
    "CharStorage": np.dtype(np.int8),
    "ByteStorage": np.dtype(np.uint8),
    "BoolStorage": np.dtype(np.bool_),
}
_STORAGE_BY_DTYPE = {v: k for k, v in STORAGE_DTYPES.items()}
_TORCH_DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16",
                      "int8", "uint8", "bool", "float", "double", "half", "long", "int", "short")
# Megatron enums that appear in the ``args`` Namespace of real checkpoints (args.model_type, ...).
_MEGATRON_ENUMS = {
    ("megatron.core.enums", "ModelType"), ("megatron.core.transformer.enums", "AttnBackend"),
    ("megatron.core.transformer.enums", "AttnMaskType"), ("megatron.core.transformer.enums",
                                                          "AttnType"),
    ("megatron.core.transformer.enums", "LayerType"), ("megatron.model.enums", "ModelType"),
}


class GlobalRef:
    """A global (``module.name``) that pickles as itself without importing the module.

    Instances are unique per name, so a pickle memoizes them like the real object. Calling one
    (for the Megatron enums) gives a ``GlobalCall`` that pickles back as the same call.
    """

    _cache: Dict[Tuple[str, str], "GlobalRef"] = {}

    def __new__(cls, module: str, name: str) -> "GlobalRef":
        key = (module, name)
        if key not in cls._cache:
            obj = super().__new__(cls)
            obj.module, obj.name = module, name
            cls._cache[key] = obj
        return cls._cache[key]

    def __call__(self, *args):
        return GlobalCall(self, args)

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"

    def __reduce__(self):  # only reached by a foreign pickler; keeps identity semantics
        return (GlobalRef, (self.module, self.name))


class GlobalCall:
    """``ref(*args)`` kept symbolic, e.g. ``megatron.core.enums.ModelType(1)``."""

    def __init__(self, ref: GlobalRef, args: tuple):
        self.ref, self.args = ref, args

    def __eq__(self, other) -> bool:
        return isinstance(other, GlobalCall) and (self.ref, self.args) == (other.ref, other.args)

    def __repr__(self) -> str:
        return f"{self.ref!r}{self.args!r}"


def torch_dtype(name: str) -> GlobalRef:
    """The pickled form of ``torch.<name>`` (e.g. ``args.params_dtype = torch.bfloat16``)."""
    if name not in _TORCH_DTYPE_NAMES:
        raise ValueError(f"unknown torch dtype name {name!r}")
    return GlobalRef("torch", name)


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------

class _Storage:
    """A storage record of an open archive: dtype, element count, byte range in the file."""

    def __init__(self, archive: "_Archive", key: str, dtype: np.dtype, numel: int):
        self.archive, self.key, self.dtype, self.numel = archive, key, dtype, numel


class LazyTensor:
    """A tensor of a torch checkpoint whose bytes stay on disk until ``numpy()`` is called."""

    def __init__(self, storage: _Storage, offset: int, shape: tuple, stride: tuple):
        self.storage, self.offset = storage, int(offset)
        self.shape, self.stride = tuple(int(s) for s in shape), tuple(int(s) for s in stride)

    @property
    def dtype(self) -> np.dtype:
        return self.storage.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def numpy(self) -> np.ndarray:
        """A fresh, contiguous, writable array (views with offsets/strides are resolved)."""
        st, item = self.storage, self.dtype.itemsize
        if any(s == 0 for s in self.shape):
            return np.zeros(self.shape, dtype=self.dtype)
        span = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride))
        if self.offset + span > st.numel or any(s < 0 for s in self.stride):
            raise TorchFormatError(f"{st.archive.path}: tensor view (offset {self.offset}, shape "
                                   f"{self.shape}, stride {self.stride}) exceeds storage "
                                   f"{st.key} of {st.numel} elements")
        flat = np.empty(span, dtype=self.dtype)
        st.archive.read_storage_into(st.key, self.offset * item, flat)
        if _contiguous_strides(self.shape) == self.stride:
            return flat.reshape(self.shape)
        view = np.lib.stride_tricks.as_strided(flat, self.shape,
                                               tuple(s * item for s in self.stride))
        return np.ascontiguousarray(view)

    def __repr__(self) -> str:
        return f"LazyTensor(shape={self.shape}, dtype={self.dtype})"


def _contiguous_strides(shape: tuple) -> tuple:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


class _Archive:
    """Random access to the stored (uncompressed) records of a torch zip file."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.zf = zipfile.ZipFile(path)
        except FileNotFoundError:
            raise
        except (zipfile.BadZipFile, OSError) as e:
            raise TorchFormatError(_not_zip_message(path, e)) from None
        names = self.zf.namelist()
        pkl = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1] or \
            [n for n in names if n == "data.pkl"]
        if not pkl:
            raise TorchFormatError(f"{path}: zip archive without data.pkl (not a torch.save "
                                   f"checkpoint)")
        self.prefix = pkl[0][: -len("data.pkl")]
        self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size
        self._offsets: Dict[str, Tuple[int, int]] = {}

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.zf.close()

    def record(self, name: str) -> bytes:
        try:
            return self.zf.read(self.prefix + name)
        except KeyError:
            raise TorchFormatError(f"{self.path}: record {self.prefix + name!r} missing") from None
        except (zipfile.BadZipFile, zlib.error, EOFError) as e:
            raise TorchFormatError(f"{self.path}: record {name!r} unreadable ({e}); the file "
                                   f"is truncated or corrupt") from None

    def _data_range(self, key: str) -> Tuple[int, int]:
        if key not in self._offsets:
            name = f"{self.prefix}data/{key}"
            try:
                info = self.zf.getinfo(name)
            except KeyError:
                raise TorchFormatError(f"{self.path}: storage record {name!r} missing") from None
            if info.compress_type != zipfile.ZIP_STORED:
                raise TorchFormatError(f"{self.path}: storage {name!r} is compressed; torch "
                                       f"writes stored records")
            head = os.pread(self.fd, 30, info.header_offset)
            if len(head) < 30 or head[:4] != b"PK\x03\x04":
                raise TorchFormatError(f"{self.path}: bad local header for {name!r} (truncated "
                                       f"or corrupt file)")
            n_name, n_extra = struct.unpack("<HH", head[26:30])
            start = info.header_offset + 30 + n_name + n_extra
            self._offsets[key] = (start, info.file_size)
        return self._offsets[key]

    def read_storage_into(self, key: str, byte_offset: int, out: np.ndarray) -> None:
        """Fill ``out`` (contiguous) from the storage bytes at ``byte_offset``, no extra copy."""
        start, size = self._data_range(key)
        nbytes = out.nbytes
        if byte_offset + nbytes > size:
            raise TorchFormatError(f"{self.path}: storage {key} holds {size} bytes, a tensor "
                                   f"needs {byte_offset + nbytes}")
        view = memoryview(out.reshape(-1).view(np.uint8))
        done = 0
        while done < nbytes:
            n = os.preadv(self.fd, [view[done:]], start + byte_offset + done)
            if n <= 0:
                raise TorchFormatError(f"{self.path}: truncated (storage {key} ends past the "
                                       f"end of the file)")
            done += n


def _not_zip_message(path: str, err: Exception) -> str:
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError:
        head = b""
    if head[:2] == b"\x80\x02" or head[:1] == b"\x80":
        return (f"{path}: legacy (pre-1.6, non-zip) torch format is not supported; re-save it "
                f"with a current torch.save")
    return f"{path}: not a torch zip checkpoint or truncated ({err})"


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False,
                       backward_hooks=None, metadata=None):
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError("_rebuild_tensor_v2 without a storage")
    return LazyTensor(storage, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad=True, backward_hooks=None, state=None):
    return data


def _codecs_encode(text, encoding="latin1"):
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise ForbiddenGlobalError("_codecs.encode is only allowed as protocol 2 bytes encoding")
    return text.encode("latin1")


def _set(items=()):
    return set(items)


def _frozenset(items=()):
    return frozenset(items)


def _numpy_globals() -> dict:
    from numpy.core import multiarray
    return {("numpy.core.multiarray", "_reconstruct"): multiarray._reconstruct,
            ("numpy._core.multiarray", "_reconstruct"): multiarray._reconstruct,
            ("numpy.core.multiarray", "scalar"): multiarray.scalar,
            ("numpy._core.multiarray", "scalar"): multiarray.scalar,
            ("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}


_ALLOWED: Dict[Tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("argparse", "Namespace"): argparse.Namespace,
    ("_codecs", "encode"): _codecs_encode,
    ("builtins", "set"): _set,
    ("builtins", "frozenset"): _frozenset,
    ("_io", "BytesIO"): io.BytesIO,
}


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: _Archive):
        super().__init__(io.BytesIO(data))
        self.archive = archive
        self.storages: Dict[str, _Storage] = {}

    def find_class(self, module: str, name: str):
        key = (module, name)
        if key in _ALLOWED:
            return _ALLOWED[key]
        if module == "torch" and name in STORAGE_DTYPES:
            return GlobalRef(module, name)
        if module == "torch" and name in _TORCH_DTYPE_NAMES:
            return GlobalRef(module, name)
        if key in _MEGATRON_ENUMS:
            return GlobalRef(module, name)
        numpy_ok = _numpy_globals()
        if key in numpy_ok:
            return numpy_ok[key]
        raise ForbiddenGlobalError(f"{self.archive.path}: pickle asks for the global "
                                   f"{module}.{name}, which a checkpoint does not need "
                                   f"(refused; nothing was executed)")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"{self.archive.path}: unsupported persistent id "
                                         f"{pid!r:.80}")
        _, stype, key, _location, numel = pid
        if not isinstance(stype, GlobalRef) or stype.name not in STORAGE_DTYPES:
            raise pickle.UnpicklingError(f"{self.archive.path}: unsupported storage type "
                                         f"{stype!r}")
        if key not in self.storages:
            self.storages[key] = _Storage(self.archive, str(key), STORAGE_DTYPES[stype.name],
                                          int(numel))
        return self.storages[key]


def _materialize(obj):
    if isinstance(obj, LazyTensor):
        return obj.numpy()
    if isinstance(obj, collections.OrderedDict):
        return collections.OrderedDict((k, _materialize(v)) for k, v in obj.items())
    if isinstance(obj, dict):
        return {k: _materialize(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_materialize(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_materialize(v) for v in obj)
    if isinstance(obj, argparse.Namespace):
        return argparse.Namespace(**{k: _materialize(v) for k, v in vars(obj).items()})
    return obj


class TorchCheckpoint:
    """An open torch file: ``obj`` holds ``LazyTensor`` leaves; close (or use ``with``) after."""

    def __init__(self, path: str):
        self.archive = _Archive(path)
        byteorder = self._optional("byteorder")
        if byteorder not in (None, b"little"):
            self.archive.close()
            raise TorchFormatError(f"{path}: byteorder {byteorder!r} is not supported (only "
                                   f"little-endian)")
        try:
            self.obj = _RestrictedUnpickler(self.archive.record("data.pkl"), self.archive).load()
        except ForbiddenGlobalError:
            self.archive.close()
            raise
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
            self.archive.close()
            if isinstance(e, TorchFormatError):
                raise
            raise TorchFormatError(f"{path}: data.pkl cannot be unpickled ({e})") from None

    def _optional(self, name: str) -> Optional[bytes]:
        try:
            return self.archive.zf.read(self.archive.prefix + name)
        except KeyError:
            return None

    def close(self) -> None:
        self.archive.close()

    def __enter__(self) -> "TorchCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load(path: str, lazy: bool = False):
    """Load a ``torch.save`` zip file. ``lazy=False`` returns plain Python/NumPy objects;
    ``lazy=True`` returns a ``TorchCheckpoint`` whose ``obj`` has ``LazyTensor`` leaves (keep it
    open while reading tensors)."""
    ckpt = TorchCheckpoint(path)
    if lazy:
        return ckpt
    try:
        return _materialize(ckpt.obj)
    finally:
        ckpt.close()


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
        self.stride = tuple(stride) if stride is not None else _contiguous_strides(self.shape)


class _TorchPickler(pickle._Pickler):
    """Pure-Python pickler (the C one would import ``torch`` to check globals) that emits the
    same opcodes as ``torch.save``'s pickler."""

    dispatch = dict(pickle._Pickler.dispatch)

    def __init__(self, file, protocol: int):
        super().__init__(file, protocol=protocol)
        self._storage_pid: Dict[int, tuple] = {}

    def persistent_id(self, obj):
        if isinstance(obj, _StorageRef):
            return ("storage", GlobalRef("torch", _STORAGE_BY_DTYPE[obj.dtype]), obj.key, "cpu",
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
        if arr.dtype not in _STORAGE_BY_DTYPE:
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
