"""Damage done to a checkpoint folder of any format (ms-llm's own, ``checkpoint.format torch``,
a converted legacy Megatron folder, torch_dist), for the fault matrix and the integrity tests:
a byte flipped inside a tensor's bytes, the main file truncated or removed, its metadata
replaced by garbage, the tracker naming no iteration. Each damages iteration 1's files in place
(copy the folder first)."""
from __future__ import annotations

import os
import zipfile

TRACKER = "latest_checkpointed_iteration.txt"
IT = "iter_0000001"


def main_file(folder: str, fmt: str) -> str:
    """The file holding the tensors of ``folder``'s iteration 1."""
    it = os.path.join(folder, IT)
    if fmt == "native":
        return os.path.join(it, "rank_00000.safetensors")
    if fmt == "torch_dist":
        return os.path.join(it, "__0_0.distcp")
    return os.path.join(it, "mp_rank_00", "model_optim_rng.pt")   # torch, legacy


def metadata_file(folder: str, fmt: str) -> str:
    """What describes the tensors: ``metadata.json``, ``.metadata``, or a .pt's ``data.pkl``
    (inside the zip; ``garbage_metadata`` overwrites that entry's bytes)."""
    it = os.path.join(folder, IT)
    return {"native": os.path.join(it, "metadata.json"),
            "torch_dist": os.path.join(it, ".metadata")}.get(fmt, main_file(folder, fmt))


def _entry_data(path: str, name_part: str, largest: bool = False):
    """(first byte, length) of a stored zip entry whose name holds ``name_part``, inside
    ``path`` (the largest such entry with ``largest``)."""
    with zipfile.ZipFile(path) as zf:
        infos = [i for i in zf.infolist() if name_part in i.filename.split("/", 1)[-1]]
        info = max(infos, key=lambda i: i.file_size) if largest else infos[0]
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        n_name, n_extra = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
    return info.header_offset + 30 + n_name + n_extra, info.file_size


def _xor_byte(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))


def flip_tensor_byte(folder: str, fmt: str) -> None:
    """One bit of one byte in the middle of the largest tensor's bytes: nothing else changes."""
    path = main_file(folder, fmt)
    if fmt == "native":
        at = os.path.getsize(path) - 4
    elif fmt == "torch_dist":
        from ms_llm.checkpoint.torch_dist.io import TorchDistReader
        chunk = max((c for e in TorchDistReader(os.path.dirname(path)).tensors.values()
                     for c in e.chunks), key=lambda c: c.length)
        at = chunk.byte_offset + chunk.length // 2   # inside the chunk blob's storage
    else:
        start, size = _entry_data(path, "data/", largest=True)
        at = start + size // 2
    _xor_byte(path, at)


def truncate(folder: str, fmt: str) -> None:
    path = main_file(folder, fmt)
    os.truncate(path, os.path.getsize(path) // 2)


def remove(folder: str, fmt: str) -> None:
    os.remove(main_file(folder, fmt))


def garbage_metadata(folder: str, fmt: str) -> None:
    path = metadata_file(folder, fmt)
    if fmt in ("native", "torch_dist"):
        with open(path, "wb") as f:
            f.write(b"\xff{ garbage")
    else:   # the pickle inside the zip, same length: only its CRC-32 can tell
        start, size = _entry_data(path, "data.pkl")
        with open(path, "r+b") as f:
            f.seek(start)
            f.write(b"\xff" * min(size, 16))


def tracker_naming_no_iteration(folder: str, fmt: str) -> None:
    with open(os.path.join(folder, TRACKER), "w", encoding="utf-8") as f:
        f.write("not-an-iteration")


DAMAGE = {"flipped-tensor-byte": flip_tensor_byte, "truncated": truncate,
          "missing-file": remove, "garbage-metadata": garbage_metadata,
          "tracker-no-iteration": tracker_naming_no_iteration}
