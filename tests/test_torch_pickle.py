"""Torch-free ``.pt`` I/O (``ms_llm.checkpoint.torch_pickle``) against real torch.

torch is the independent reference here: files written by ``torch.save`` must read back with the
same values (bit patterns compared, so bf16/fp16 are exact), files we write must load with
``torch.load(weights_only=True)``, and for the same object our ``data.pkl`` and storage records
must be byte-identical to ``torch.save``'s. No tolerances: every comparison is exact.
"""
from __future__ import annotations

import argparse
import collections
import io
import os
import zipfile

import ml_dtypes
import numpy as np
import pytest

from ms_llm.checkpoint import torch_pickle as tp

torch = pytest.importorskip("torch")

_DTYPES = [(torch.float32, np.float32), (torch.float16, np.float16),
           (torch.bfloat16, ml_dtypes.bfloat16), (torch.int64, np.int64),
           (torch.int32, np.int32), (torch.int8, np.int8), (torch.uint8, np.uint8),
           (torch.bool, np.bool_), (torch.float64, np.float64)]


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"u{a.dtype.itemsize}")


def _t2np(t):
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.contiguous().numpy()


def _torch_objects():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    shared = torch.arange(40, dtype=torch.float32)
    obj = {
        "plain": torch.randn(3, 5, generator=g),
        "transposed": base.t(),                          # strides (1, 8)
        "sliced": base[2:5, 1:7:2],                      # offset 17, strides (8, 2)
        "shared_a": shared[4:20].view(4, 4),             # two views of one storage
        "shared_b": shared[10:],
        "param": torch.nn.Parameter(torch.randn(2, 3, generator=g)),
        "none": None,
        "nested": {"list": [torch.ones(2, dtype=torch.int32), (1, "x", 2.5)],
                   "od": collections.OrderedDict(b=torch.zeros(1), a=3)},
        "args": argparse.Namespace(num_layers=2, params_dtype=torch.bfloat16, name="m",
                                   sizes=[1, 2]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
    }
    for k, (td, _) in enumerate(_DTYPES):
        x = torch.randn(4, 3, generator=g) * 50
        obj[f"dt_{k}"] = x.to(td) if td != torch.bool else x > 0
    return obj


def _check_equal(ours, ref, path="obj"):
    if isinstance(ref, torch.Tensor):
        assert isinstance(ours, np.ndarray), path
        assert ours.shape == tuple(ref.shape), path
        np.testing.assert_array_equal(_bits(ours), _bits(_t2np(ref.detach())), err_msg=path)
    elif isinstance(ref, dict):
        assert type(ours) is type(ref) and list(ours) == list(ref), path
        for k in ref:
            _check_equal(ours[k], ref[k], f"{path}.{k}")
    elif isinstance(ref, (list, tuple)):
        assert type(ours) is type(ref) and len(ours) == len(ref), path
        for k, (a, b) in enumerate(zip(ours, ref)):
            _check_equal(a, b, f"{path}[{k}]")
    elif isinstance(ref, argparse.Namespace):
        assert isinstance(ours, argparse.Namespace), path
        _check_equal(vars(ours), vars(ref), path)
    elif isinstance(ref, torch.dtype):
        assert isinstance(ours, tp.GlobalRef) and repr(ours) == str(ref), path
    else:
        assert ours == ref, path


@pytest.mark.parametrize("protocol", [2, 4])
def test_reads_torch_save(tmp_path, protocol):
    obj = _torch_objects()
    f = tmp_path / "m.pt"
    torch.save(obj, f, pickle_protocol=protocol)
    _check_equal(tp.load(str(f)), obj)
    # lazy: nothing read until asked, view metadata kept
    ck = tp.load(str(f), lazy=True)
    try:
        lt = ck.obj["sliced"]
        assert isinstance(lt, tp.LazyTensor) and lt.stride == (8, 2) and lt.offset == 17
        np.testing.assert_array_equal(lt.numpy(), obj["sliced"].numpy())
    finally:
        ck.close()


def test_written_files_load_in_torch_weights_only(tmp_path):
    rng = np.random.default_rng(0)
    ours = {"model": collections.OrderedDict(
        (f"t{k}", (rng.standard_normal((5, 3)) * 40).astype(nd) if nd is not np.bool_
         else rng.standard_normal(7) > 0) for k, (_, nd) in enumerate(_DTYPES)),
        "args": argparse.Namespace(num_layers=3, params_dtype=tp.torch_dtype("bfloat16")),
        "checkpoint_version": 3.0, "iteration": 1, "none": None, "list": [1, (2, "a")]}
    f = tmp_path / "model_optim_rng.pt"
    tp.save(ours, str(f))
    with torch.serialization.safe_globals([argparse.Namespace]):
        for mmap in (False, True):  # mmap=True also checks 64-byte storage alignment
            back = torch.load(f, weights_only=True, mmap=mmap)
            assert back["args"].params_dtype is torch.bfloat16
            assert back["checkpoint_version"] == 3.0 and back["none"] is None
            assert back["list"] == [1, (2, "a")]
            for k, v in ours["model"].items():
                assert back["model"][k].dtype == dict(
                    (np.dtype(n), t) for t, n in _DTYPES)[v.dtype]
                np.testing.assert_array_equal(_bits(_t2np(back["model"][k])), _bits(v))
    # and our own reader round-trips it
    again = tp.load(str(f))
    for k, v in ours["model"].items():
        np.testing.assert_array_equal(_bits(again["model"][k]), _bits(v))


def test_pickle_and_storages_byte_identical_to_torch_save(tmp_path):
    rng = np.random.default_rng(1)
    arrays = collections.OrderedDict(
        a=rng.standard_normal((4, 6)).astype(np.float32),
        b=(rng.standard_normal(5) * 10).astype(ml_dtypes.bfloat16),
        c=np.arange(7, dtype=np.int64))
    ns = argparse.Namespace(tensor_model_parallel_size=2, params_dtype=tp.torch_dtype("bfloat16"))
    ours = {"args": ns, "checkpoint_version": 3.0, "iteration": 1, "model": arrays,
            "x": None}
    ref = {"args": argparse.Namespace(tensor_model_parallel_size=2, params_dtype=torch.bfloat16),
           "checkpoint_version": 3.0, "iteration": 1,
           "model": collections.OrderedDict(
               (k, torch.from_numpy(v.view(np.int16)).view(torch.bfloat16)
                if v.dtype == ml_dtypes.bfloat16 else torch.from_numpy(v))
               for k, v in arrays.items()), "x": None}
    tp.save(ours, str(tmp_path / "model_optim_rng.pt"))
    os.makedirs(tmp_path / "ref")
    torch.save(ref, tmp_path / "ref" / "model_optim_rng.pt")
    za, zb = zipfile.ZipFile(tmp_path / "model_optim_rng.pt"), \
        zipfile.ZipFile(tmp_path / "ref" / "model_optim_rng.pt")
    names_b = [n for n in zb.namelist() if "serialization_id" not in n]
    assert sorted(n for n in za.namelist() if "serialization_id" not in n) == sorted(names_b)
    for n in names_b:
        assert za.read(n) == zb.read(n), n


def _zip_with_pickle(path, pkl: bytes):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/version", "3\n")


def test_forbidden_global_is_refused_without_running(tmp_path):
    marker = tmp_path / "pwned"
    evil = (b"\x80\x02cos\nsystem\nq\x00X" + len(f"touch {marker}").to_bytes(4, "little")
            + f"touch {marker}".encode() + b"\x85R.")
    f = tmp_path / "evil.pt"
    _zip_with_pickle(f, evil)
    with pytest.raises(tp.ForbiddenGlobalError, match="os.system"):
        tp.load(str(f))
    assert not marker.exists()
    # a builtins global that would run code through REDUCE is refused too
    _zip_with_pickle(f, b"\x80\x02cbuiltins\neval\nX\x04\x00\x00\x001+1\x85R.")
    with pytest.raises(tp.ForbiddenGlobalError, match="builtins.eval"):
        tp.load(str(f))


def test_truncated_and_non_torch_files(tmp_path):
    good = tmp_path / "g.pt"
    tp.save({"w": np.ones((64, 64), np.float32)}, str(good))
    data = good.read_bytes()
    for cut in (len(data) // 2, len(data) - 10):
        bad = tmp_path / f"cut{cut}.pt"
        bad.write_bytes(data[:cut])
        with pytest.raises(tp.TorchFormatError, match="truncated|not a torch zip"):
            tp.load(str(bad))
    legacy = tmp_path / "legacy.pt"
    legacy.write_bytes(b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19.")
    with pytest.raises(tp.TorchFormatError, match="legacy"):
        tp.load(str(legacy))
    # a zip whose storage record is shorter than its tensor needs
    buf = io.BytesIO()
    torch.save({"w": torch.ones(8)}, buf)
    z = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    short = tmp_path / "short.pt"
    with zipfile.ZipFile(short, "w") as out:
        for n in z.namelist():
            out.writestr(n, z.read(n)[:8] if n.endswith("data/0") else z.read(n))
    with pytest.raises(tp.TorchFormatError, match="holds 8 bytes"):
        tp.load(str(short))
