"""Megatron mmap indexed dataset: our reader/writer against an independent struct-level
implementation of the format written here (from the published layout), in both directions."""
import os
import struct

import numpy as np
import pytest

from ms_llm.data.indexed import IndexedDataset, IndexedDatasetBuilder, optimal_dtype, write_indexed_dataset

# Megatron's DType codes, restated independently of the module under test.
CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7, np.uint16: 8}


def ref_write(prefix, docs, dtype):
    """Independent writer. ``docs`` is a list of documents, each a list of sequences."""
    dtype = np.dtype(dtype)
    lengths, pointers, doc_idx, ptr = [], [], [0], 0
    with open(prefix + ".bin", "wb") as fh:
        for doc in docs:
            for seq in doc:
                data = np.asarray(seq, dtype=dtype).tobytes()
                fh.write(data)
                lengths.append(len(seq))
                pointers.append(ptr)
                ptr += len(data)
            doc_idx.append(len(lengths))
    with open(prefix + ".idx", "wb") as fh:
        fh.write(b"MMIDIDX\x00\x00")
        fh.write(struct.pack("<Q", 1))
        fh.write(struct.pack("<B", CODES[dtype.type]))
        fh.write(struct.pack("<Q", len(lengths)))
        fh.write(struct.pack("<Q", len(doc_idx)))
        fh.write(struct.pack(f"<{len(lengths)}i", *lengths))
        fh.write(struct.pack(f"<{len(pointers)}q", *pointers))
        fh.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))


def ref_read(prefix):
    """Independent reader -> (dtype code, list of documents of lists of sequences)."""
    raw = open(prefix + ".idx", "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack_from("<Q", raw, 9)
    (code,) = struct.unpack_from("<B", raw, 17)
    n_seq, n_doc = struct.unpack_from("<QQ", raw, 18)
    off = 34
    lengths = struct.unpack_from(f"<{n_seq}i", raw, off)
    pointers = struct.unpack_from(f"<{n_seq}q", raw, off + 4 * n_seq)
    doc_idx = struct.unpack_from(f"<{n_doc}q", raw, off + 12 * n_seq)
    assert version == 1 and len(raw) == off + 12 * n_seq + 8 * n_doc
    dtype = np.dtype({v: k for k, v in CODES.items()}[code])
    data = open(prefix + ".bin", "rb").read()
    seqs = [np.frombuffer(data, dtype=dtype, count=n, offset=p).tolist() for n, p in zip(lengths, pointers)]
    return code, [seqs[doc_idx[i]:doc_idx[i + 1]] for i in range(n_doc - 1)]


def _docs(rng, n_docs, max_seqs=1, vocab=60000):
    return [[rng.randint(0, vocab, size=rng.randint(0, 9)).tolist() for _ in range(rng.randint(1, max_seqs + 1))]
            for _ in range(n_docs)]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8, np.int16])
def test_reference_files_read_back(tmp_path, dtype):
    rng = np.random.RandomState(1)
    vocab = 200 if dtype in (np.uint8,) else 30000
    docs = _docs(rng, 25, max_seqs=3, vocab=vocab)
    prefix = str(tmp_path / "ref")
    ref_write(prefix, docs, dtype)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.dtype(dtype)
    flat = [s for d in docs for s in d]
    assert len(ds) == len(flat) and ds.num_documents == len(docs)
    for i, s in enumerate(flat):
        assert ds[i].tolist() == s
    for d, doc in enumerate(docs):
        assert [x.tolist() for x in ds.document(d)] == doc
    # get(offset, length) slices the middle of a sequence without reading the rest
    longest = max(range(len(flat)), key=lambda i: len(flat[i]))
    assert ds.get(longest, offset=1, length=3).tolist() == flat[longest][1:4]
    assert ds[-1].tolist() == flat[-1]
    with pytest.raises(IndexError):
        ds.get(longest, offset=len(flat[longest]), length=1)


def test_builder_is_byte_identical_to_reference(tmp_path):
    rng = np.random.RandomState(2)
    docs = _docs(rng, 40, max_seqs=4)
    for dtype in (np.uint16, np.int32):
        ref = str(tmp_path / f"ref_{np.dtype(dtype).name}")
        ours = str(tmp_path / f"ours_{np.dtype(dtype).name}")
        ref_write(ref, docs, dtype)
        b = IndexedDatasetBuilder(ours + ".bin", dtype)
        for i, doc in enumerate(docs):
            if i % 2:  # both APIs Megatron offers
                b.add_document([t for s in doc for t in s], [len(s) for s in doc])
            else:
                for s in doc:
                    b.add_item(np.asarray(s))
                b.end_document()
        b.finalize(ours + ".idx")
        for ext in (".bin", ".idx"):
            assert open(ref + ext, "rb").read() == open(ours + ext, "rb").read(), ext
        code, back = ref_read(ours)
        assert code == CODES[np.dtype(dtype).type] and back == docs


def test_add_index_merges_like_one_build(tmp_path):
    rng = np.random.RandomState(3)
    parts = [_docs(rng, n, max_seqs=2) for n in (5, 0, 7)]
    prefixes = []
    for i, docs in enumerate(parts):
        p = str(tmp_path / f"part{i}")
        ref_write(p, docs, np.uint16)
        prefixes.append(p)
    merged = str(tmp_path / "merged")
    b = IndexedDatasetBuilder(merged + ".bin", np.uint16)
    for p in prefixes:
        b.add_index(p)
    b.finalize(merged + ".idx")
    ref_write(str(tmp_path / "whole"), [d for docs in parts for d in docs], np.uint16)
    for ext in (".bin", ".idx"):
        assert open(merged + ext, "rb").read() == open(str(tmp_path / "whole") + ext, "rb").read()
    with pytest.raises(ValueError, match="dtype"):
        IndexedDatasetBuilder(str(tmp_path / "x.bin"), np.int32).add_index(prefixes[0])


def test_incomplete_outputs_never_look_complete(tmp_path):
    p = str(tmp_path / "d")
    b = IndexedDatasetBuilder(p + ".bin", np.int32)
    b.add_item([1, 2, 3])
    b.end_document()
    assert not os.path.exists(p + ".bin") and not os.path.exists(p + ".idx")
    b.finalize(p + ".idx", commit=False)
    assert not os.path.exists(p + ".bin") and not os.path.exists(p + ".idx")
    b.abort()
    assert os.listdir(tmp_path) == []
    write_indexed_dataset(p, [[1, 2], [3]], np.int32)
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]
    assert [x.tolist() for x in IndexedDataset(p)] == [[1, 2], [3]]


def test_corrupt_files_give_one_line_errors(tmp_path):
    p = str(tmp_path / "d")
    write_indexed_dataset(p, [[1, 2, 3], [4, 5]], np.int32)
    good_idx = open(p + ".idx", "rb").read()
    cases = {
        "bad magic": b"XXIDIDX\x00\x00" + good_idx[9:],
        "truncated index": good_idx[:-4],
        "dtype code": good_idx[:17] + b"\x63" + good_idx[18:],
    }
    for why, data in cases.items():
        open(p + ".idx", "wb").write(data)
        with pytest.raises(ValueError) as ei:
            IndexedDataset(p)
        assert why in str(ei.value) and p + ".idx" in str(ei.value) and "\n" not in str(ei.value)
    open(p + ".idx", "wb").write(good_idx)
    open(p + ".bin", "wb").write(b"\x00" * 8)
    with pytest.raises(ValueError, match="truncated data"):
        IndexedDataset(p)
    with pytest.raises(FileNotFoundError, match="nope.idx"):
        IndexedDataset(str(tmp_path / "nope"))


def test_optimal_dtype_rule():
    assert optimal_dtype(65499) == np.uint16 and optimal_dtype(65500) == np.int32 and optimal_dtype(151936) == np.int32
