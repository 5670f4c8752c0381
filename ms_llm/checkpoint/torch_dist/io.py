"""Megatron-Core's ``torch_dist`` checkpoints (``--ckpt-format torch_dist``) without torch.

The folder is a torch Distributed Checkpoint (DCP) plus Megatron's two files::

    .metadata        pickled torch.distributed.checkpoint Metadata: per key, the global shape
                     and chunks (offsets, sizes); per chunk, (file, byte offset, length)
    __R_I.distcp     the chunks; a tensor chunk is one ``torch.save`` zip blob, a bytes item
                     (``ShardedObject``: rng state, ``_extra_state``) is raw bytes
    common.pt        torch.save of the non-sharded items (``iteration``, ``args``, scheduler...)
    metadata.json    {"sharded_backend": "torch_dist", ...}

Reading parses ``.metadata`` with an unpickler that resolves only the DCP record classes (as
plain records) and assembles any key from its chunks, whatever the layout that saved it: the
format is layout-free. Writing emits the same records as GLOBAL references so torch and
megatron-core load the folder; one file holds every chunk (a one-writer save).
"""
from __future__ import annotations

import io
import json
import os
import pickle
import tempfile
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .. import torch_pickle
from ..torch_pickle.format import GlobalRef, TorchFormatError, torch_dtype
from ..torch_pickle.reader import load as load_torch_file

METADATA, COMMON, BACKEND = ".metadata", "common.pt", "metadata.json"
_DCP = "torch.distributed.checkpoint"


class _Record:
    """A DCP dataclass or enum member as read: constructor args in ``args``, fields as attrs."""

    fields: Tuple[str, ...] = ()    # the dataclass's field order (positional construction)

    def __init__(self, *args, **kwargs):
        self.args = args
        self.__dict__.update(zip(self.fields, args))
        self.__dict__.update(kwargs)

    def __setstate__(self, state) -> None:
        if isinstance(state, tuple) and len(state) == 2:   # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state


_FIELDS = {"Metadata": ("state_dict_metadata", "planner_data", "storage_data", "storage_meta"),
           "MetadataIndex": ("fqn", "offset", "index"),
           "ChunkStorageMetadata": ("offsets", "sizes"),
           "TensorStorageMetadata": ("properties", "size", "chunks"),
           "TensorProperties": ("dtype",),
           "_StorageInfo": ("relative_path", "offset", "length")}


def _record(name: str) -> type:
    return type(name, (_Record,), {"fields": _FIELDS.get(name, ())})


_CLASSES = {(f"{_DCP}.metadata", n): _record(n) for n in (
    "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata",
    "BytesStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")}
_CLASSES.update({(f"{_DCP}.planner", n): _record(n) for n in (
    "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")})
_CLASSES[(f"{_DCP}.filesystem", "_StorageInfo")] = _record("_StorageInfo")


class _MetadataUnpickler(pickle.Unpickler):
    """Only the DCP records, ``torch.Size`` (a tuple), dtypes and layouts (their names)."""

    def find_class(self, module: str, name: str):
        if (module, name) in _CLASSES:
            return _CLASSES[(module, name)]
        if (module, name) == ("builtins", "dict"):   # storage_data as ms-llm writes it
            return dict
        if (module, name) == ("torch", "Size"):
            return lambda dims=(): tuple(int(d) for d in dims)
        if module == "torch" and name in _TORCH_NAMES:
            return name
        if (module, name) == ("torch.serialization", "_get_layout"):
            return lambda layout: layout
        raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata record")


_TORCH_NAMES = {"float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8",
                "uint8", "bool", "strided", "contiguous_format"}


@dataclass
class Chunk:
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    file: str = ""
    byte_offset: int = 0
    length: int = 0


@dataclass
class TensorEntry:
    shape: Tuple[int, ...]
    dtype: str
    chunks: List[Chunk] = field(default_factory=list)


def is_torch_dist_dir(path: str) -> bool:
    """Whether ``path`` holds a torch_dist checkpoint (an unreadable ``metadata.json`` says
    no; ``checkpoint.formats`` names what is wrong with such a folder)."""
    f = os.path.join(path, BACKEND)
    if not (os.path.isfile(f) and os.path.isfile(os.path.join(path, METADATA))):
        return False
    try:
        with open(f, encoding="utf-8") as fh:
            meta = json.load(fh)
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("sharded_backend") == "torch_dist"


class TorchDistReader:
    """Keys, shapes and whole tensors of a torch_dist folder (``tensor(key)``)."""

    def __init__(self, path: str):
        self.path = path
        mpath = os.path.join(path, METADATA)
        if not os.path.isfile(mpath):
            raise ValueError(f"{mpath} is missing (the save did not finish)")
        self.tensors: Dict[str, TensorEntry] = {}
        self.objects: Dict[str, Chunk] = {}
        try:   # a damaged file may provoke any error while it is parsed and walked
            with open(mpath, "rb") as f:
                self._index(_MetadataUnpickler(f).load())
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"{mpath}: not a torch_dist metadata file ({type(e).__name__}: "
                             f"{' '.join(str(e).split())[:160]})") from None
        from .verify import torch_dist_problem   # chunks inside files, no aliasing
        why = torch_dist_problem(self)
        if why:
            raise ValueError(why)
        common = os.path.join(path, COMMON)
        self.common = load_torch_file(common) if os.path.isfile(common) else {}

    def _index(self, meta) -> None:
        """Tensors (shape, dtype, chunks) and byte items from the parsed ``.metadata``."""
        for key, m in meta.state_dict_metadata.items():
            if type(m).__name__ == "TensorStorageMetadata":
                props = m.properties   # TensorProperties pickles its fields as a tuple
                dtype = getattr(props, "dtype", None) or props.state[0]
                self.tensors[key] = TensorEntry(tuple(m.size), str(dtype), [
                    Chunk(tuple(c.offsets), tuple(c.sizes)) for c in m.chunks])
        for idx, info in meta.storage_data.items():
            where = (info.relative_path, int(info.offset), int(info.length))
            if idx.fqn in self.tensors:
                off = tuple(idx.offset)
                chunk = next((c for c in self.tensors[idx.fqn].chunks if c.offsets == off), None)
                if chunk is None:
                    raise ValueError(f"{idx.fqn}: bytes stored for a chunk at {list(off)} "
                                     f"that it does not list")
                chunk.file, chunk.byte_offset, chunk.length = where
            else:
                self.objects[idx.fqn] = Chunk((), (), *where)

    def _blob(self, c: Chunk) -> bytes:
        with open(os.path.join(self.path, c.file), "rb") as f:
            f.seek(c.byte_offset)
            data = f.read(c.length)
        if len(data) != c.length:
            raise ValueError(f"{os.path.join(self.path, c.file)}: truncated at byte "
                             f"{c.byte_offset + len(data)} (want {c.length} bytes)")
        return data

    def tensor(self, key: str) -> np.ndarray:
        """The whole tensor ``key``, assembled from every chunk that saved part of it."""
        if key not in self.tensors:
            raise KeyError(f"{self.path}: no tensor {key!r} in the torch_dist checkpoint")
        e = self.tensors[key]
        out: Optional[np.ndarray] = None
        for c in e.chunks:
            with tempfile.NamedTemporaryFile(suffix=".pt") as tmp:
                tmp.write(self._blob(c))
                tmp.flush()
                part = np.asarray(_chunk_file(tmp.name, c, self.path))
            want = int(np.prod(c.sizes, dtype=np.int64))
            if part.size != want or (e.dtype in _TORCH_NAMES and str(part.dtype) != e.dtype):
                raise ValueError(f"{os.path.join(self.path, c.file)}: tensor {key!r} chunk at "
                                 f"{list(c.offsets)} holds {part.size} {part.dtype} values, "
                                 f".metadata records {list(c.sizes)} {e.dtype}")
            if out is None:
                out = np.zeros(e.shape, part.dtype)
            out[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))] = \
                part.reshape(c.sizes)
        return out

    def object_bytes(self, key: str) -> bytes:
        return self._blob(self.objects[key])


def _chunk_file(tmp: str, c: Chunk, folder: str):
    """A chunk's ``torch.save`` blob (zip CRC-32 checked), its errors naming the ``.distcp``
    file and byte range instead of the temporary copy."""
    try:
        return load_torch_file(tmp)
    except TorchFormatError as e:
        where = f"{os.path.join(folder, c.file)} bytes {c.byte_offset}..{c.byte_offset + c.length}"
        raise TorchFormatError(str(e).replace(tmp, where)) from None


class TorchDistWriter:
    """Write chunks (``add``), then ``close(common)``: the folder megatron-core loads."""

    def __init__(self, path: str):
        os.makedirs(path, exist_ok=True)
        self.path, self.file = path, "__0_0.distcp"
        self._out = open(os.path.join(path, self.file), "wb")
        self.entries: Dict[str, TensorEntry] = {}

    def add(self, key: str, shape: Tuple[int, ...], offsets: Tuple[int, ...],
            array: np.ndarray) -> None:
        """Chunk ``array`` of the global tensor ``key`` (``shape``) at ``offsets``."""
        buf = io.BytesIO()
        with tempfile.NamedTemporaryFile(suffix=".pt") as tmp:
            torch_pickle.save(np.ascontiguousarray(array), tmp.name)
            buf.write(open(tmp.name, "rb").read())
        start = self._out.tell()
        self._out.write(buf.getvalue())
        e = self.entries.setdefault(key, TensorEntry(tuple(shape), str(array.dtype)))
        e.chunks.append(Chunk(tuple(offsets), tuple(array.shape), self.file, start,
                              self._out.tell() - start))

    def close(self, common: Dict[str, Any]) -> None:
        self._out.close()
        torch_pickle.save(common, os.path.join(self.path, COMMON))
        with open(os.path.join(self.path, METADATA), "wb") as f:
            torch_pickle.dump_records(_metadata_records(self.entries), f)
        with open(os.path.join(self.path, BACKEND), "w", encoding="utf-8") as f:
            json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                       "common_backend": "torch", "common_backend_version": 1}, f)


def _metadata_records(entries: Dict[str, TensorEntry]):
    """The DCP ``Metadata`` as GLOBAL calls torch's unpickler rebuilds."""
    meta = GlobalRef(f"{_DCP}.metadata", "Metadata")
    size = GlobalRef("torch", "Size")
    tsm = GlobalRef(f"{_DCP}.metadata", "TensorStorageMetadata")
    props = GlobalRef(f"{_DCP}.metadata", "TensorProperties")
    csm = GlobalRef(f"{_DCP}.metadata", "ChunkStorageMetadata")
    index = GlobalRef(f"{_DCP}.metadata", "MetadataIndex")
    info = GlobalRef(f"{_DCP}.filesystem", "_StorageInfo")
    sdm, storage = {}, []      # storage_data: dict(pairs), its keys are records
    for key, e in entries.items():
        sdm[key] = tsm(props(torch_dtype(_TORCH_DTYPE[e.dtype])), size(e.shape),
                       [csm(size(c.offsets), size(c.sizes)) for c in e.chunks])
        for c in e.chunks:
            storage.append((index(key, size(c.offsets), None),
                            info(c.file, c.byte_offset, c.length)))
    return meta(sdm, None, GlobalRef("builtins", "dict")(storage))


_TORCH_DTYPE = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
                "float64": "float64", "int64": "int64", "int32": "int32"}
