"""Torch-free ``.pt`` I/O (``ms_llm.checkpoint.torch_pickle``).

Where torch is installed it is the independent reference: files written by ``torch.save`` must
read back with the same values (bit patterns compared, so bf16/fp16 are exact), files we write
must load with ``torch.load(weights_only=True)``, and for the same object our ``data.pkl`` and
storage records must be byte-identical to ``torch.save``'s. No tolerances: every comparison is
exact. Those tests take the ``torch`` fixture and skip without torch; the rest (round trips,
refusals of crafted files) need no torch and always run.
"""
from __future__ import annotations

import argparse
import collections
import io
import os
import pickle
import struct
import tracemalloc
import zipfile

import ml_dtypes
import numpy as np
import pytest

from ms_llm.checkpoint import torch_pickle as tp

# torch dtype name -> NumPy dtype, for every storage type
_NP_DTYPES = [("float32", np.float32), ("float16", np.float16), ("bfloat16", ml_dtypes.bfloat16),
              ("int64", np.int64), ("int32", np.int32), ("int8", np.int8), ("uint8", np.uint8),
              ("bool", np.bool_), ("float64", np.float64)]


@pytest.fixture
def torch():
    """The reference implementation; tests that cross-check against it skip without it."""
    return pytest.importorskip("torch")


def _dtypes(torch) -> list:
    return [(getattr(torch, name), nd) for name, nd in _NP_DTYPES]


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"u{a.dtype.itemsize}")


def _t2np(torch, t):
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.contiguous().numpy()


def _torch_objects(torch):
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
    for k, (td, _) in enumerate(_dtypes(torch)):
        x = torch.randn(4, 3, generator=g) * 50
        obj[f"dt_{k}"] = x.to(td) if td != torch.bool else x > 0
    return obj


def _check_equal(torch, ours, ref, path="obj"):
    if isinstance(ref, torch.Tensor):
        assert isinstance(ours, np.ndarray), path
        assert ours.shape == tuple(ref.shape), path
        np.testing.assert_array_equal(_bits(ours), _bits(_t2np(torch, ref.detach())),
                                      err_msg=path)
    elif isinstance(ref, dict):
        assert type(ours) is type(ref) and list(ours) == list(ref), path
        for k in ref:
            _check_equal(torch, ours[k], ref[k], f"{path}.{k}")
    elif isinstance(ref, (list, tuple)):
        assert type(ours) is type(ref) and len(ours) == len(ref), path
        for k, (a, b) in enumerate(zip(ours, ref)):
            _check_equal(torch, a, b, f"{path}[{k}]")
    elif isinstance(ref, argparse.Namespace):
        assert isinstance(ours, argparse.Namespace), path
        _check_equal(torch, vars(ours), vars(ref), path)
    elif isinstance(ref, torch.dtype):
        assert isinstance(ours, tp.GlobalRef) and repr(ours) == str(ref), path
    else:
        assert ours == ref, path


@pytest.mark.parametrize("protocol", [2, 4])
def test_reads_torch_save(tmp_path, protocol, torch):
    obj = _torch_objects(torch)
    f = tmp_path / "m.pt"
    torch.save(obj, f, pickle_protocol=protocol)
    _check_equal(torch, tp.load(str(f)), obj)
    # lazy: nothing read until asked, view metadata kept
    ck = tp.load(str(f), lazy=True)
    try:
        lt = ck.obj["sliced"]
        assert isinstance(lt, tp.LazyTensor) and lt.stride == (8, 2) and lt.offset == 17
        np.testing.assert_array_equal(lt.numpy(), obj["sliced"].numpy())
    finally:
        ck.close()


def test_written_files_load_in_torch_weights_only(tmp_path, torch):
    rng = np.random.default_rng(0)
    ours = {"model": collections.OrderedDict(
        (f"t{k}", (rng.standard_normal((5, 3)) * 40).astype(nd) if nd is not np.bool_
         else rng.standard_normal(7) > 0) for k, (_, nd) in enumerate(_NP_DTYPES)),
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
                    (np.dtype(n), t) for t, n in _dtypes(torch))[v.dtype]
                np.testing.assert_array_equal(_bits(_t2np(torch, back["model"][k])), _bits(v))
    # and our own reader round-trips it
    again = tp.load(str(f))
    for k, v in ours["model"].items():
        np.testing.assert_array_equal(_bits(again["model"][k]), _bits(v))


def test_pickle_and_storages_byte_identical_to_torch_save(tmp_path, torch):
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
    tp.save({"w": np.ones(8, np.float32)}, str(good))
    z = zipfile.ZipFile(good)
    short = tmp_path / "short.pt"
    with zipfile.ZipFile(short, "w") as out:
        for n in z.namelist():
            out.writestr(n, z.read(n)[:8] if n.endswith("data/0") else z.read(n))
    with pytest.raises(tp.TorchFormatError, match="holds 8 bytes"):
        tp.load(str(short))


def test_round_trip_without_torch(tmp_path):
    rng = np.random.default_rng(2)
    model = collections.OrderedDict(
        (f"t{k}", (rng.standard_normal((3, 4)) * 9).astype(nd)) for k, (_, nd) in
        enumerate(_NP_DTYPES))
    args = argparse.Namespace(num_layers=2, params_dtype=tp.torch_dtype("bfloat16"), name="m",
                              model_type=tp.GlobalRef("megatron.core.enums", "ModelType")(1))
    obj = {"args": args, "checkpoint_version": 3.0, "iteration": 1, "model": model,
           "nested": {"l": [1, (2, "x")], "none": None, "s": {1, 2}}}
    f = str(tmp_path / "model_optim_rng.pt")
    tp.save(obj, f, protocol=4)
    back = tp.load(f)
    assert back["args"] == args and back["args"].params_dtype is tp.torch_dtype("bfloat16")
    assert back["nested"] == obj["nested"] and list(back["model"]) == list(model)
    for k, v in model.items():
        np.testing.assert_array_equal(_bits(back["model"][k]), _bits(v))


def test_numpy_and_metadata_contents_still_load(tmp_path):
    """What real Megatron files hold besides tensors (NumPy RNG state and scalars, state-dict
    ``_metadata``, TransformerEngine's BytesIO extra state, sets) passes the BUILD checks."""
    od = collections.OrderedDict(a=1)
    od._metadata = {"": {"version": 1}}
    obj = {"np_rng": np.random.RandomState(3).get_state(), "scalar": np.float64(2.5), "od": od,
           "extra": io.BytesIO(b"fp8 meta"), "sets": (frozenset([1]), {2})}
    f = tmp_path / "m.pt"
    _zip_with_pickle(f, pickle.dumps(obj, protocol=2))
    back = tp.load(str(f))
    np.testing.assert_array_equal(back["np_rng"][1], obj["np_rng"][1])
    assert back["scalar"] == 2.5 and back["od"] == od and back["sets"] == obj["sets"]
    assert back["extra"].getvalue() == b"fp8 meta"
    with tp.load(str(f), lazy=True) as ck:
        assert ck.obj["od"]._metadata == od._metadata


def _u(text: str) -> bytes:  # BINUNICODE
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _g(module: str, name: str) -> bytes:  # GLOBAL
    return f"c{module}\n{name}\n".encode()


_SETATTRS = b"N}(" + _u("__init__") + _g("_codecs", "encode") + _u("__eq__") + \
    _g("builtins", "set") + b"u\x86"  # (None, {...}): BUILD's setattr form
# Crafted pickles that try to change process-wide objects (or smuggle code into data) via BUILD.
_BUILD_ATTACKS = {
    "dtype marker, dict state": _g("torch", "bfloat16") + b"}(" + _u("module") + _u("os") +
    _u("name") + _u("system") + b"ub",
    "dtype marker, setattr state": _g("torch", "bfloat16") + b"N}(" + _u("module") + _u("os") +
    _u("name") + _u("system") + b"u\x86b",
    "Namespace class, setattr state": _g("argparse", "Namespace") + _SETATTRS + b"b",
    "Namespace class, dict state": _g("argparse", "Namespace") + b"}" + _u("__repr__") +
    _g("_codecs", "encode") + b"sb",
    "allowed function": _g("torch._utils", "_rebuild_tensor_v2") + b"N}" + _u("__defaults__") +
    b")s\x86b",
    "Namespace instance, function value": _g("argparse", "Namespace") + b")\x81}" + _u("f") +
    _g("_codecs", "encode") + b"sb",
    "Namespace instance, shadowing a method": _g("argparse", "Namespace") + b")\x81}" +
    _u("_get_kwargs") + b"K\x01sb",
    "OrderedDict instance, shadowing a method": _g("collections", "OrderedDict") + b")R}" +
    _u("items") + b"K\x01sb",
}


@pytest.mark.parametrize("attack", list(_BUILD_ATTACKS))
def test_build_attacks_are_refused_and_later_writes_unaffected(tmp_path, attack):
    ns_before = dict(vars(argparse.Namespace))
    bf16 = tp.torch_dtype("bfloat16")
    f = tmp_path / "evil.pt"
    _zip_with_pickle(f, b"\x80\x02" + _BUILD_ATTACKS[attack] + b".")
    with pytest.raises(tp.TorchFormatError, match="BUILD|not checkpoint data") as e:
        tp.load(str(f))
    assert str(f) in str(e.value) and "\n" not in str(e.value)
    assert dict(vars(argparse.Namespace)) == ns_before
    assert (bf16.module, bf16.name) == ("torch", "bfloat16") and bf16 is tp.torch_dtype("bfloat16")
    with pytest.raises(AttributeError):
        bf16.module = "os"
    out = tmp_path / "after.pt"
    tp.save({"args": argparse.Namespace(params_dtype=bf16), "w": np.ones(2, np.float32)}, str(out))
    pkl = zipfile.ZipFile(out).read("after/data.pkl")
    assert b"ctorch\nbfloat16\n" in pkl and b"system" not in pkl and b"\nos\n" not in pkl
    back = tp.load(str(out))
    assert back["args"] == argparse.Namespace(params_dtype=bf16)
    assert repr(back["args"]) == "Namespace(params_dtype=torch.bfloat16)"


def _write_view(path, make) -> None:
    """A file with storages ``a`` (0..3) and ``b`` (7s) and tensor ``x = make(a, b)``."""
    w = tp.TorchZipWriter(str(path))
    a = w.add_tensor(np.arange(4, dtype=np.float32))
    b = w.add_tensor(np.full(4, 7, np.float32))
    w.close({"a": a, "x": make(a, b)})


_F32 = np.dtype(np.float32)
_BAD_VIEWS = {  # name: (x = make(a, b), what the refusal says)
    "negative offset": (lambda a, b: tp.TensorRef(b.storage, (4,), offset=-4), "negative"),
    "offset past the end": (lambda a, b: tp.TensorRef(b.storage, (4,), offset=1), "past"),
    "stride past the end": (lambda a, b: tp.TensorRef(b.storage, (4,), stride=(2,)), "past"),
    "negative stride": (lambda a, b: tp.TensorRef(b.storage, (2,), 3, (-1,)), "negative"),
    "zero strides, huge shape": (
        lambda a, b: tp.TensorRef(b.storage, (1 << 20, 1 << 20), stride=(0, 0)), "more than"),
    "shape product overflows int64": (
        lambda a, b: tp.TensorRef(b.storage, (1 << 40, 1 << 40), stride=(0, 0)), "more than"),
    "fractional size": (lambda a, b: tp.TensorRef(b.storage, (2.0,), stride=(1,)), "integers"),
    "more elements than the record": (
        lambda a, b: tp.TensorRef(tp._StorageRef(b.storage.key, _F32, 5), (5,)), "holds 16"),
}


@pytest.mark.parametrize("case", list(_BAD_VIEWS))
def test_views_outside_their_storage_are_refused(tmp_path, case):
    make, match = _BAD_VIEWS[case]
    f = tmp_path / "v.pt"
    _write_view(f, make)
    with pytest.raises(tp.TorchFormatError, match=match):
        tp.load(str(f))
    # the valid neighbour view still works
    _write_view(f, lambda a, b: tp.TensorRef(b.storage, (2, 2), 0, (1, 2)))
    np.testing.assert_array_equal(tp.load(str(f))["x"], np.full((2, 2), 7, np.float32))


def _patch_central_size(data: bytes, member: bytes, size: int) -> bytes:
    """``data`` with the central-directory sizes of ``member`` set to ``size``."""
    out = bytearray(data)
    i = out.find(b"PK\x01\x02")
    while i >= 0:
        n = struct.unpack_from("<H", out, i + 28)[0]
        if out[i + 46:i + 46 + n].endswith(member):
            struct.pack_into("<II", out, i + 20, size, size)
        i = out.find(b"PK\x01\x02", i + 46)
    return bytes(out)


def test_huge_declared_sizes_are_refused_before_allocating(tmp_path):
    f = tmp_path / "huge.pt"
    # 512 GiB of float32 claimed by a tiny file
    _write_view(f, lambda a, b: tp.TensorRef(tp._StorageRef(b.storage.key, _F32, 1 << 37),
                                             (1 << 37,)))
    assert os.path.getsize(f) < 2048
    # a zip directory claiming a 4 GiB storage record in the same tiny file
    f2 = tmp_path / "huge_zip.pt"
    _write_view(f2, lambda a, b: tp.TensorRef(tp._StorageRef(b.storage.key, _F32, 1 << 30),
                                              (1 << 30,)))
    f2.write_bytes(_patch_central_size(f2.read_bytes(), b"data/1", 0xFFFFFFF0))
    tracemalloc.start()
    try:
        for path, match in ((f, "holds 16 bytes"), (f2, "past the end")):
            tracemalloc.reset_peak()
            with pytest.raises(tp.TorchFormatError, match=match):
                tp.load(str(path))
            assert tracemalloc.get_traced_memory()[1] < (1 << 20)
    finally:
        tracemalloc.stop()


def _nested_lists(depth: int) -> bytes:
    return b"(" * depth + b"l" * depth


_BOMBS = {  # crafted pickles whose objects would unfold far beyond their size
    "cycle": (b"]q\x00h\x00a", "cycle"),
    "deep nesting": (_nested_lists(150), "deeper"),
    "shared-list doubling": (b"]q\x00" + b"".join(
        b"(h%ch%clq%c" % (i, i, i + 1) for i in range(60)), "unfolds"),
    "set copies of one list": (b"(" + b"K\x01" * 2000 + b"lq\x00" + b"(" + (
        _g("builtins", "set") + b"h\x00\x85R") * 400 + b"l", "copies more"),
}


@pytest.mark.parametrize("case", list(_BOMBS))
def test_object_graph_bombs_are_refused(tmp_path, case):
    body, match = _BOMBS[case]
    f = tmp_path / "bomb.pt"
    _zip_with_pickle(f, b"\x80\x02" + body + b".")
    with pytest.raises(tp.TorchFormatError, match=match):
        tp.load(str(f))


def test_many_views_of_one_storage_are_refused(tmp_path):
    """Views are cheap to write and each materializes a full copy: bounded per file."""
    w = tp.TorchZipWriter(str(tmp_path / "views.pt"))
    base = w.add_tensor(np.zeros(1 << 16, np.float32))  # 256 KiB
    w.close([tp.TensorRef(base.storage, (1 << 16,)) for _ in range(64)])  # 16 MiB of copies
    with pytest.raises(tp.TorchFormatError, match="tensor views add up"):
        tp.load(str(tmp_path / "views.pt"))
    with tp.load(str(tmp_path / "views.pt"), lazy=True) as ck:  # lazily, one at a time is fine
        assert ck.obj[63].numpy().shape == (1 << 16,)
