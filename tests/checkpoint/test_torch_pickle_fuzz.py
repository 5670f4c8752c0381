"""Fuzzing the torch-free ``.pt`` reader (``ms_llm.checkpoint.torch_pickle``).

Real files written by the project's own writer (a Megatron-shaped checkpoint dict, a nested
state dict with shared-storage views, protocols 2 and 4) are damaged in seeded ways: bytes flipped
or replaced, opcode runs spliced or opcodes inserted in ``data.pkl``; ``data.pkl`` / a storage /
the whole zip truncated; zip headers mutated; bytes flipped anywhere. Every damaged file must either load or raise ``TorchFormatError`` -- never any other
exception -- and no load may allocate more than ``_alloc_bound(file size)`` (see there). No torch
needed; fixed seeds, so a failure names a reproducible case.
"""
from __future__ import annotations

import argparse
import collections
import io
import pickletools
import random
import tracemalloc
import zipfile

import ml_dtypes
import numpy as np
import pytest

from ms_llm.checkpoint import torch_pickle as tp

N_MUTATIONS = 2160  # 3 samples x 9 kinds x 80
SEED = 20240611


def _alloc_bound(file_size: int) -> int:
    """The most one load may allocate (tracemalloc peak above the pre-load baseline).

    The reader checks every size a record declares against the file before allocating, so a
    load's memory is linear in the file: the zip directory and ``data.pkl`` copies (a few times
    the file), the pure-Python unpickler's objects (tens of bytes per pickle byte, and the pickle
    is a part of the file), tensors (at most the storage bytes they view), plus a constant for
    the zipfile/pickle machinery. Measured on these samples (2.5-4.5 kB): at most ~17 x the file.
    32 x the file + 256 KiB keeps a margin and is still far below what damaged sizes claim
    (gigabytes to terabytes).
    """
    return 32 * file_size + (256 << 10)


def _megatron_like(rng: np.random.Generator) -> dict:
    args = argparse.Namespace(num_layers=2, hidden_size=8, params_dtype=tp.torch_dtype("bfloat16"),
                              model_type=tp.GlobalRef("megatron.core.enums", "ModelType")(1),
                              tensor_model_parallel_size=1, name="tiny", sizes=[1, 2, 3],
                              lr=3e-4, use_flash=False, extra=None)
    model = collections.OrderedDict([
        ("embedding.word_embeddings.weight",
         rng.standard_normal((16, 8)).astype(ml_dtypes.bfloat16)),
        ("decoder.layers.0.self_attention.linear_qkv.weight",
         rng.standard_normal((24, 8)).astype(np.float32)),
        ("decoder.layers.0.mlp.linear_fc1.bias", rng.standard_normal(8).astype(np.float32)),
        ("decoder.final_layernorm.weight", np.ones(8, ml_dtypes.bfloat16)),
        ("position_ids", np.arange(12, dtype=np.int64)),
    ])
    return {"args": args, "checkpoint_version": 3.0, "iteration": 1, "model": model,
            "rng_state": [{"random_rng_state": (3, (1, 2, 3), None), "seed": 1234}],
            "opt": {"step": 7, "groups": [{"lr": 1e-3, "params": [0, 1, 2]}]}}


def _write_views(path: str, rng: np.random.Generator) -> None:
    """A nested state dict whose tensors share storages through offset/strided views."""
    w = tp.TorchZipWriter(path)
    base = w.add_tensor(rng.standard_normal((6, 8)).astype(np.float32))
    ints = w.add_tensor(np.arange(20, dtype=np.int64))
    obj = {"plain": w.add_tensor(rng.standard_normal(5).astype(ml_dtypes.bfloat16)),
           "transposed": tp.TensorRef(base.storage, (8, 6), 0, (1, 8)),
           "sliced": tp.TensorRef(base.storage, (3, 3), 17, (8, 2)),
           "ints": {"a": tp.TensorRef(ints.storage, (4, 4), 2), "b": ints,
                    "list": [ints, (1, "x", 2.5), {"deep": [None, True, b"raw"]}]},
           "empty": w.add_tensor(np.zeros((0, 4), np.float32))}
    w.close(obj)


def _samples(tmp_path) -> list:
    rng = np.random.default_rng(SEED)
    paths = []
    for proto in (2, 4):
        p = str(tmp_path / f"megatron_p{proto}.pt")
        tp.save(_megatron_like(rng), p, protocol=proto)
        paths.append(p)
    p = str(tmp_path / "views.pt")
    _write_views(p, rng)
    paths.append(p)
    return [open(p, "rb").read() for p in paths]


def _members(data: bytes) -> list:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return [(i.filename, z.read(i)) for i in z.infolist()]


def _rezip(members: list) -> bytes:
    """The members as a fresh, self-consistent zip (right CRCs and sizes), so damage inside a
    record reaches the reader instead of stopping at zipfile's CRC check."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as z:
        for name, payload in members:
            z.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), payload)
    return buf.getvalue()


def _with_record(members: list, pick, change) -> bytes:
    return _rezip([(n, change(b) if pick(n) else b) for n, b in members])


def _flip_bytes(r: random.Random, b: bytes) -> bytes:
    out = bytearray(b)
    for _ in range(r.randint(1, 4)):
        i = r.randrange(len(out))
        out[i] = r.choice((out[i] ^ (1 << r.randrange(8)), r.randrange(256)))
    return bytes(out)


def _random_run(r: random.Random, b: bytes) -> bytes:
    i = r.randrange(len(b))
    return b[:i] + r.randbytes(r.randint(1, 16)) + b[i + r.randint(0, 16):]


def _splice(r: random.Random, b: bytes) -> bytes:
    """Copy a run of real opcodes elsewhere: plausible pickles that reach BUILD, REDUCE and the
    item opcodes with the wrong objects on the stack."""
    i, n, j = r.randrange(len(b)), r.randint(1, 24), r.randrange(len(b))
    return b[:j] + b[i:i + n] + b[j:]


_OPCODES = bytes(sorted({op.code.encode("latin1")[0] for op in pickletools.opcodes}))


def _insert_opcode(r: random.Random, b: bytes) -> bytes:
    i = r.randrange(len(b))
    return b[:i] + bytes([r.choice(_OPCODES)]) + b[i:]


def _zip_header_spans(data: bytes) -> list:
    """Byte ranges of the local headers, the central directory and the end record."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        spans = [(i.header_offset, i.header_offset + 30 + len(i.filename)) for i in z.infolist()]
        cd = z.start_dir
    return spans + [(cd, len(data))]


def _mutate(kind: str, r: random.Random, data: bytes, members: list) -> bytes:
    is_pkl = lambda n: n.endswith("data.pkl")  # noqa: E731
    storages = [n for n, _ in members if "/data/" in n]
    if kind == "pkl_flip":
        return _with_record(members, is_pkl, lambda b: _flip_bytes(r, b))
    if kind == "pkl_random":
        return _with_record(members, is_pkl, lambda b: _random_run(r, b))
    if kind == "pkl_splice":
        return _with_record(members, is_pkl, lambda b: _splice(r, b))
    if kind == "pkl_opcode":
        return _with_record(members, is_pkl, lambda b: _insert_opcode(r, b))
    if kind == "pkl_truncate":
        return _with_record(members, is_pkl, lambda b: b[:r.randrange(len(b))])
    if kind == "storage_truncate":
        name = r.choice(storages)
        return _with_record(members, lambda n: n == name, lambda b: b[:r.randrange(len(b) + 1)])
    if kind == "zip_truncate":
        return data[:r.randrange(len(data))]
    if kind == "zip_header":
        lo, hi = r.choice(_zip_header_spans(data))
        out = bytearray(data)
        for _ in range(r.randint(1, 3)):
            out[r.randrange(lo, hi)] = r.randrange(256)
        return bytes(out)
    assert kind == "file_flip"
    return _flip_bytes(r, data)


KINDS = ("pkl_flip", "pkl_random", "pkl_splice", "pkl_opcode", "pkl_truncate",
         "storage_truncate", "zip_truncate", "zip_header", "file_flip")


def test_damaged_files_load_or_raise_torch_format_error(tmp_path):
    samples = _samples(tmp_path)
    parsed = [_members(s) for s in samples]
    for s in samples:  # the undamaged files load (and warm up lazy imports before measuring)
        (tmp_path / "x.pt").write_bytes(s)
        tp.load(str(tmp_path / "x.pt"))
    r = random.Random(SEED)
    counts = collections.Counter()
    path = tmp_path / "fuzz.pt"
    tracemalloc.start()
    try:
        for i in range(N_MUTATIONS):
            k = i % len(samples)
            kind = KINDS[(i // len(samples)) % len(KINDS)]
            data = _mutate(kind, r, samples[k], parsed[k])
            path.write_bytes(data)
            case = f"mutation {i} ({kind} of sample {k}, seed {SEED})"
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            try:
                tp.load(str(path))
                counts["loaded"] += 1
            except tp.TorchFormatError as e:
                assert "\n" not in str(e) and str(path) in str(e), (case, str(e))
                counts["refused"] += 1
            except BaseException as e:  # noqa: BLE001  (anything else is the bug we look for)
                pytest.fail(f"{case}: {type(e).__name__}: {e}")
            peak = tracemalloc.get_traced_memory()[1] - base
            assert peak <= _alloc_bound(len(data)), (case, peak, len(data))
            counts["peak_max"] = max(counts["peak_max"], peak)
    finally:
        tracemalloc.stop()
    assert counts["loaded"] + counts["refused"] == N_MUTATIONS
    assert counts["loaded"] > 50 and counts["refused"] > 1000, counts
