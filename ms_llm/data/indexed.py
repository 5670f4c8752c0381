"""Megatron mmap indexed dataset (``.bin`` + ``.idx``): reader and writer, bit-compatible.

Why: it is the one on-disk format both lanes (PyTorch/Megatron and MindSpore) read, so the
files written here must be byte-identical to Megatron-Core's ``IndexedDatasetBuilder`` output
and Megatron's files must read back unchanged.

``.idx`` layout (little endian)::

    b"MMIDIDX\\x00\\x00"  <Q version=1  <B dtype code  <Q sequence count  <Q document count
    int32[sequence count]   sequence lengths (in elements)
    int64[sequence count]   byte offsets of each sequence in ``.bin``
    int64[document count]   document boundaries as sequence indices, starting with 0

``.bin`` is the raw concatenation of all sequences in the index dtype.
"""
from __future__ import annotations

import os
import struct
from array import array
from typing import Iterable, Optional, Sequence

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1

DTYPE_CODES: dict = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


def dtype_code(dtype) -> int:
    """Megatron's ``DType.code_from_dtype``."""
    try:
        return _CODE_OF[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"dtype {np.dtype(dtype)} has no Megatron indexed-dataset code") from None


def optimal_dtype(vocab_size: Optional[int]) -> np.dtype:
    """Megatron's ``DType.optimal_dtype``: uint16 below 65500 ids, int32 otherwise."""
    return np.dtype(np.uint16) if vocab_size is not None and vocab_size < 65500 else np.dtype(np.int32)


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def dataset_exists(prefix: str) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


class IndexedDatasetBuilder:
    """Streaming writer with Megatron-Core's ``IndexedDatasetBuilder`` API.

    Data goes to ``<bin>.tmp``; ``finalize(idx)`` writes ``<idx>.tmp`` and renames ``.bin`` then
    ``.idx`` into place, so a crash never leaves a pair that looks complete (the ``.idx`` is the
    completion marker). ``abort()`` removes the temporaries.
    """

    def __init__(self, bin_file: str, dtype=np.int32):
        self.bin_file = bin_file
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)
        self._tmp_bin = bin_file + ".tmp"
        self._fh = open(self._tmp_bin, "wb")
        # int64 arrays, not lists: 16 bytes per document instead of ~70 (the only state that grows)
        self.sequence_lengths = array("q")
        self.document_indices = array("q", [0])
        self._finalized = False

    def add_item(self, seq) -> None:
        """Append one sequence (any int sequence / array), cast to the builder dtype."""
        arr = np.asarray(seq, dtype=self.dtype)
        self._fh.write(arr.tobytes(order="C"))
        self.sequence_lengths.append(int(arr.size))

    def add_document(self, seq, lengths: Sequence[int]) -> None:
        """Append a whole document made of sequences of the given lengths."""
        arr = np.asarray(seq, dtype=self.dtype)
        if int(sum(lengths)) != arr.size:
            raise ValueError(f"add_document: lengths sum to {sum(lengths)} but the document has {arr.size} elements")
        self._fh.write(arr.tobytes(order="C"))
        self.sequence_lengths.extend(int(x) for x in lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def add_items(self, flat, lengths) -> None:
        """Bulk ``add_item`` + ``end_document`` per item: ``flat`` is the concatenation of items
        of ``lengths``; zero-length items are skipped (no empty documents)."""
        arr = np.asarray(flat, dtype=self.dtype)
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != arr.size:
            raise ValueError(f"add_items: lengths sum to {int(lengths.sum())} but {arr.size} elements given")
        lengths = lengths[lengths > 0]
        self._fh.write(arr.tobytes(order="C"))
        base = len(self.sequence_lengths)
        self.sequence_lengths.frombytes(lengths.tobytes())
        self.document_indices.frombytes(np.arange(base + 1, base + 1 + len(lengths), dtype=np.int64).tobytes())

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, prefix: str) -> None:
        """Append another indexed dataset (same dtype) — how multi-worker outputs are merged."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"{idx_path(prefix)}: dtype {other.dtype} differs from builder dtype {self.dtype}")
        offset = len(self.sequence_lengths)
        self.sequence_lengths.frombytes(np.asarray(other.sequence_lengths, dtype=np.int64).tobytes())
        self.document_indices.frombytes((np.asarray(other.document_indices[1:], dtype=np.int64) + offset).tobytes())
        del other
        with open(bin_path(prefix), "rb") as src:
            while True:
                chunk = src.read(1 << 24)
                if not chunk:
                    break
                self._fh.write(chunk)

    def finalize(self, idx_file: str, commit: bool = True) -> None:
        """Write the index. With ``commit=False`` both files stay under temp names until
        ``commit()``, so several datasets can be made visible together at the very end."""
        self._fh.close()
        lengths64 = np.frombuffer(self.sequence_lengths, dtype=np.int64) if len(self.sequence_lengths) else np.zeros(0, np.int64)
        if len(lengths64) and int(lengths64.max()) > np.iinfo(np.int32).max:
            raise ValueError("a sequence is longer than int32 allows")
        lengths = lengths64.astype(np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        docs = np.frombuffer(self.document_indices, dtype=np.int64).copy()
        tmp_idx = idx_file + ".tmp"
        with open(tmp_idx, "wb") as fh:
            fh.write(INDEX_HEADER)
            fh.write(struct.pack("<Q", INDEX_VERSION))
            fh.write(struct.pack("<B", dtype_code(self.dtype)))
            fh.write(struct.pack("<Q", len(lengths)))
            fh.write(struct.pack("<Q", len(docs)))
            fh.write(lengths.tobytes(order="C"))
            fh.write(pointers.tobytes(order="C"))
            fh.write(docs.tobytes(order="C"))
        self._tmp_idx, self._idx_file = tmp_idx, idx_file
        if commit:
            self.commit()

    def commit(self) -> None:
        """Rename ``.bin`` then ``.idx`` into place (the index appears last)."""
        os.replace(self._tmp_bin, self.bin_file)
        os.replace(self._tmp_idx, self._idx_file)
        self._finalized = True

    def abort(self) -> None:
        """Close and delete the temporary files (no-op after ``commit``)."""
        if self._finalized:
            return
        if not self._fh.closed:
            self._fh.close()
        for p in (self._tmp_bin, getattr(self, "_tmp_idx", None)):
            if p and os.path.exists(p):
                os.remove(p)


class IndexedDataset:
    """Read-only memory-mapped Megatron indexed dataset; ``ds[i]`` is sequence ``i``.

    ``get(i, offset, length)`` returns a slice of sequence ``i`` without touching the rest
    (what ``GPTDataset`` uses).
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        ipath = idx_path(prefix)
        if not os.path.isfile(ipath):
            raise FileNotFoundError(f"indexed dataset index not found: {ipath}")
        if not os.path.isfile(bin_path(prefix)):
            raise FileNotFoundError(f"indexed dataset data not found: {bin_path(prefix)}")
        with open(ipath, "rb") as fh:
            head = fh.read(len(INDEX_HEADER) + 8 + 1 + 8 + 8)
        if len(head) < len(INDEX_HEADER) + 25 or head[: len(INDEX_HEADER)] != INDEX_HEADER:
            raise ValueError(f"{ipath}: not a Megatron mmap index (bad magic)")
        off = len(INDEX_HEADER)
        (version,) = struct.unpack_from("<Q", head, off)
        if version != INDEX_VERSION:
            raise ValueError(f"{ipath}: unsupported index version {version}")
        (code,) = struct.unpack_from("<B", head, off + 8)
        if code not in DTYPE_CODES:
            raise ValueError(f"{ipath}: unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        n_seq, n_doc = struct.unpack_from("<QQ", head, off + 9)
        header_len = off + 25
        need = header_len + n_seq * 4 + n_seq * 8 + n_doc * 8
        if os.path.getsize(ipath) < need:
            raise ValueError(f"{ipath}: truncated index ({os.path.getsize(ipath)} bytes, need {need})")
        self._idx = np.memmap(ipath, dtype=np.uint8, mode="r")
        self.sequence_lengths = np.frombuffer(self._idx, dtype=np.int32, count=n_seq, offset=header_len)
        self.sequence_pointers = np.frombuffer(self._idx, dtype=np.int64, count=n_seq, offset=header_len + n_seq * 4)
        self.document_indices = np.frombuffer(self._idx, dtype=np.int64, count=n_doc, offset=header_len + n_seq * 12)
        bsize = os.path.getsize(bin_path(prefix))
        end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize if n_seq else 0
        if bsize < end:
            raise ValueError(f"{bin_path(prefix)}: truncated data ({bsize} bytes, index needs {end})")
        self._bin = np.memmap(bin_path(prefix), dtype=np.uint8, mode="r") if bsize else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return int(self.sequence_lengths.shape[0])

    @property
    def num_documents(self) -> int:
        return int(self.document_indices.shape[0]) - 1

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        n = len(self)
        if not 0 <= idx < n:
            raise IndexError(f"sequence {idx} out of range for {n} sequences in {self.prefix}")
        size = int(self.sequence_lengths[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"slice [{offset}:{offset + length}] outside sequence {idx} of length {size}")
        start = int(self.sequence_pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)

    def __getitem__(self, idx: int) -> np.ndarray:
        if idx < 0:
            idx += len(self)
        return self.get(idx)

    def document(self, doc: int) -> list:
        """All sequences of document ``doc`` (the SFT/packing view of the index)."""
        lo, hi = int(self.document_indices[doc]), int(self.document_indices[doc + 1])
        return [self.get(i) for i in range(lo, hi)]


def write_indexed_dataset(prefix: str, sequences: Iterable, dtype=np.int32, document_ends: Optional[Iterable[int]] = None) -> None:
    """Convenience: one sequence per document unless ``document_ends`` (sequence counts) is given."""
    b = IndexedDatasetBuilder(bin_path(prefix), dtype)
    try:
        ends = set(document_ends) if document_ends is not None else None
        for i, s in enumerate(sequences):
            b.add_item(s)
            if ends is None or (i + 1) in ends:
                b.end_document()
        b.finalize(idx_path(prefix))
    finally:
        b.abort()
