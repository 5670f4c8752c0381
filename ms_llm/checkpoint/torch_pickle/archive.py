"""The byte layer of the torch ``.pt`` reader: zip records, storages and lazy tensor views.

Why every size is checked before use: the zip directory, the storage element counts and the
tensor views all come from the file, so a few bytes can claim terabytes. A storage's byte range
must lie inside the file, its element count inside the zip member's declared size, and a view
(offset, shape, stride) inside its storage -- all checked when the object is created, so
``LazyTensor.numpy()`` never allocates more than the storage it reads.

Why every storage's CRC-32 is checked: the zip directory records one per entry (torch and
ms-llm's writer both fill it), and a flipped byte inside a tensor changes nothing else, so it is
the only thing that tells a corrupted tensor from a good one. Small records go through
``zipfile`` (which checks it at the end of each read); storages are read with ``pread`` (no
extra copy), so their CRC is computed on the bytes read -- a whole-storage read costs nothing
more; a partial view makes one streaming pass over its storage, once per storage.
"""
from __future__ import annotations

import math
import os
import struct
import zipfile
import zlib
from typing import Dict, Optional, Tuple

import numpy as np

from .format import TorchFormatError, contiguous_strides

MAX_NDIM = 32  # NumPy's own limit on array dimensions


def one_line(err: BaseException, limit: int = 160) -> str:
    """``err`` as a short single line for an error message (type name when it has no text)."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[:limit] + "..."


class Archive:
    """Random access to the stored (uncompressed) records of a torch zip file."""

    def __init__(self, path: str):
        self.path = path
        self.zf = _open_zip(path)
        self.fd: Optional[int] = None
        try:
            self.prefix = _archive_prefix(path, self.zf.namelist())
            self.fd = os.open(path, os.O_RDONLY)
            self.size = os.fstat(self.fd).st_size
        except BaseException:
            self.close()
            raise
        self._ranges: Dict[str, Tuple[int, int]] = {}
        self._crc_ok: set = set()

    def fail(self, what: str) -> TorchFormatError:
        """The one-line error for this file (names from the file may hold newlines)."""
        return TorchFormatError(f"{self.path}: {' '.join(what.split())}")

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.zf.close()

    def _stored_info(self, name: str, optional: bool = False) -> Optional[zipfile.ZipInfo]:
        """The zip entry of a record, refused unless stored and inside the file: its declared
        sizes are what every later size check trusts."""
        try:
            info = self.zf.getinfo(self.prefix + name)
        except KeyError:
            if optional:
                return None
            raise self.fail(f"record {self.prefix + name!r} missing") from None
        if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 1:
            raise self.fail(f"record {name!r} is compressed or encrypted; torch writes stored "
                            f"records")
        if info.compress_size != info.file_size or info.header_offset < 0 or \
                info.header_offset + info.file_size > self.size:
            raise self.fail(f"record {name!r} declares {info.file_size} bytes at offset "
                            f"{info.header_offset}, past the end of the {self.size}-byte file "
                            f"(truncated or corrupt)")
        return info

    def record(self, name: str, optional: bool = False) -> Optional[bytes]:
        """A whole (small) record such as ``data.pkl``; None if optional and absent."""
        info = self._stored_info(name, optional)
        if info is None:
            return None
        try:
            return self.zf.read(info)
        except Exception as e:  # noqa: BLE001  (any zipfile complaint means a corrupt file)
            raise self.fail(f"record {name!r} unreadable ({one_line(e)}); the file is "
                            f"truncated or corrupt") from None

    def storage_size(self, key: str) -> int:
        """Declared byte length of storage ``key`` (already checked to fit in the file)."""
        return self._stored_info(f"data/{key}").file_size

    def storage_range(self, key: str) -> Tuple[int, int]:
        """(first byte in the file, byte length) of storage ``key``, checked to lie in the file."""
        if key not in self._ranges:
            name = f"data/{key}"
            info = self._stored_info(name)
            head = os.pread(self.fd, 30, info.header_offset)
            if len(head) < 30 or head[:4] != b"PK\x03\x04":
                raise self.fail(f"bad local header for {name!r} (truncated or corrupt file)")
            n_name, n_extra = struct.unpack("<HH", head[26:30])
            start = info.header_offset + 30 + n_name + n_extra
            if start + info.file_size > self.size:
                raise self.fail(f"storage {key} ({info.file_size} bytes at {start}) ends past "
                                f"the end of the {self.size}-byte file (truncated)")
            self._ranges[key] = (start, info.file_size)
        return self._ranges[key]

    def read_storage_into(self, key: str, byte_offset: int, out: np.ndarray) -> None:
        """Fill ``out`` (contiguous) from the storage bytes at ``byte_offset``, no extra copy."""
        start, size = self.storage_range(key)
        nbytes = out.nbytes
        if byte_offset < 0 or byte_offset + nbytes > size:
            raise self.fail(f"storage {key} holds {size} bytes, a tensor needs bytes "
                            f"{byte_offset}..{byte_offset + nbytes}")
        view = memoryview(out.reshape(-1).view(np.uint8))
        done = 0
        while done < nbytes:
            n = os.preadv(self.fd, [view[done:]], start + byte_offset + done)
            if n <= 0:
                raise self.fail(f"truncated (storage {key} ends past the end of the file)")
            done += n
        if key not in self._crc_ok:
            whole = byte_offset == 0 and nbytes == size
            self._check_crc(key, zlib.crc32(view) if whole else self._stream_crc(start, size))

    def verify_storages(self) -> None:
        """Check the CRC-32 of every storage entry (``ms-llm checkpoint verify``, resume's
        fallback): one streaming read, no tensor materialised."""
        for info in self.zf.infolist():
            if info.filename.startswith(self.prefix + "data/"):
                key = info.filename[len(self.prefix + "data/"):]
                if key not in self._crc_ok:
                    self._check_crc(key, self._stream_crc(*self.storage_range(key)))

    def _stream_crc(self, start: int, size: int) -> int:
        """CRC-32 of ``size`` bytes at ``start``, read in blocks (a partial view's storage)."""
        crc, done, step = 0, 0, 1 << 24
        while done < size:
            block = os.pread(self.fd, min(step, size - done), start + done)
            if not block:
                raise self.fail("truncated (a storage ends past the end of the file)")
            crc = zlib.crc32(block, crc)
            done += len(block)
        return crc

    def _check_crc(self, key: str, crc: int) -> None:
        """Refuse storage ``key`` unless its bytes have the CRC-32 its zip entry records."""
        info = self._stored_info(f"data/{key}")
        if crc != info.CRC:
            raise self.fail(f"entry {self.prefix}data/{key}: CRC-32 {crc:08x} differs from "
                            f"the {info.CRC:08x} the zip records (corrupted tensor bytes)")
        self._crc_ok.add(key)


def _open_zip(path: str) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(path)
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001  (zipfile raises many types on a damaged directory)
        raise TorchFormatError(_not_zip_message(path, e)) from None


def _archive_prefix(path: str, names: list) -> str:
    pkl = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1] or \
        [n for n in names if n == "data.pkl"]
    if not pkl:
        raise TorchFormatError(f"{path}: zip archive without data.pkl (not a torch.save "
                               f"checkpoint)")
    return pkl[0][: -len("data.pkl")]


def _not_zip_message(path: str, err: Exception) -> str:
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError:
        head = b""
    if head[:1] == b"\x80":
        return (f"{path}: legacy (pre-1.6, non-zip) torch format is not supported; re-save it "
                f"with a current torch.save")
    return f"{path}: not a torch zip checkpoint or truncated ({one_line(err)})"


class Storage:
    """A storage record of an open archive: dtype and element count, checked against the zip
    member's declared size (which ``Archive`` checked against the file) before any use."""

    __slots__ = ("archive", "key", "dtype", "numel")

    def __init__(self, archive: Archive, key: str, dtype: np.dtype, numel: int):
        size = archive.storage_size(key)
        if numel * dtype.itemsize > size:
            raise archive.fail(f"storage {key} holds {size} bytes, its {numel} {dtype} "
                               f"elements need {numel * dtype.itemsize}")
        self.archive, self.key, self.dtype, self.numel = archive, key, dtype, numel


class LazyTensor:
    """A tensor of a torch checkpoint whose bytes stay on disk until ``numpy()`` is called.

    The view is checked when created: non-negative integer offset, sizes and strides, every
    element inside the storage, and no more elements than the storage holds (so a small file
    cannot expand into a huge array through zero strides).
    """

    __slots__ = ("storage", "offset", "shape", "stride")

    def __init__(self, storage: Storage, offset: int, shape: tuple, stride: tuple):
        self.storage, self.offset = storage, offset
        self.shape, self.stride = tuple(shape), tuple(stride)
        problem = _view_problem(storage.numel, offset, self.shape, self.stride)
        if problem:
            raise storage.archive.fail(f"tensor view (offset {offset!r:.40}, shape "
                                       f"{self.shape!r:.80}, stride {self.stride!r:.80}) of "
                                       f"storage {storage.key}: {problem}")

    @property
    def dtype(self) -> np.dtype:
        return self.storage.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def numpy(self) -> np.ndarray:
        """A fresh, contiguous, writable array (views with offsets/strides are resolved)."""
        st, item = self.storage, self.dtype.itemsize
        if math.prod(self.shape) == 0:
            return np.zeros(self.shape, dtype=self.dtype)
        span = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride))
        flat = np.empty(span, dtype=self.dtype)
        st.archive.read_storage_into(st.key, self.offset * item, flat)
        if contiguous_strides(self.shape) == self.stride:
            return flat.reshape(self.shape)
        view = np.lib.stride_tricks.as_strided(flat, self.shape,
                                               tuple(s * item for s in self.stride))
        return np.ascontiguousarray(view)

    def __repr__(self) -> str:
        return f"LazyTensor(shape={self.shape}, dtype={self.dtype})"


def _view_problem(numel: int, offset, shape: tuple, stride: tuple) -> str:
    """What is wrong with a tensor view of a ``numel``-element storage ('' when nothing)."""
    if not all(type(v) is int for v in (offset, *shape, *stride)):
        return "offset, sizes and strides must be integers"
    if len(shape) != len(stride) or len(shape) > MAX_NDIM:
        return f"needs as many strides as sizes, at most {MAX_NDIM}"
    if offset < 0 or min(shape + stride, default=0) < 0:
        return "negative offset, size or stride"
    n = math.prod(shape)
    if n == 0:
        return "" if offset <= numel else f"offset past the storage's {numel} elements"
    if n > numel:
        return f"{n} elements, more than the storage's {numel}"
    if offset + 1 + sum((k - 1) * s for k, s in zip(shape, stride)) > numel:
        return f"reaches past the storage's {numel} elements"
    return ""
