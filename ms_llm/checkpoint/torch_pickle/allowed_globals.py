"""What a checkpoint pickle may name, and the checked stand-ins the reader gives it instead.

Why stand-ins: a global the unpickler returns is something the file can call (``REDUCE``) with
arguments of its choosing. Each function here accepts only the arguments ``torch.save`` and
NumPy's pickling produce and refuses anything else with ``Refusal``; classes are never
returned for calling, only for ``NEWOBJ`` of an empty instance (``NEW``).
"""
from __future__ import annotations

import argparse
import collections
import io
import re
from typing import Any, Dict

import numpy as np

try:
    from numpy._core import multiarray  # NumPy 2 (numpy.core is deprecated there)
except ImportError:  # NumPy 1.x
    from numpy.core import multiarray

from .archive import LazyTensor, Storage

_OD = collections.OrderedDict


class Refusal(Exception):
    """A refusal raised where the file name is unknown; the loader adds it and re-raises it as
    ``TorchFormatError``."""


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False,
                       backward_hooks=None, metadata=None) -> LazyTensor:
    if type(storage) is not Storage or type(size) not in (tuple, list) or \
            type(stride) not in (tuple, list):
        raise Refusal("_rebuild_tensor_v2 without a storage, sizes and strides")
    return LazyTensor(storage, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad=True, backward_hooks=None, state=None):
    if type(data) is not LazyTensor:
        raise Refusal("_rebuild_parameter of something other than a tensor")
    return data


def _codecs_encode(text, encoding="latin1") -> bytes:
    if type(text) is not str or encoding not in ("latin1", "latin-1"):
        raise Refusal("_codecs.encode is only allowed as protocol 2 bytes encoding")
    return text.encode("latin1")


def _set(items=()) -> set:
    return set(_sequence(items, "set"))


def _frozenset(items=()) -> frozenset:
    return frozenset(_sequence(items, "frozenset"))


def _ordered_dict(items=()) -> _OD:
    return _OD(_sequence(items, "OrderedDict", dict))


def _sequence(items, what: str, *extra: type):
    if type(items) not in (list, tuple, set, frozenset, *extra):
        raise Refusal(f"{what} of a {type(items).__name__}")
    return items


NDARRAY = object()  # ``numpy.ndarray``, only ever the first argument of ``_reconstruct``
_NUMPY_SPEC = re.compile(r"[<>|=]?(?:b1|\?|[iu][1248]|f[248]|c(?:8|16))")


def numeric(dtype) -> bool:
    return isinstance(dtype, np.dtype) and dtype.kind in "biufc" and dtype.fields is None \
        and dtype.subdtype is None


def _np_dtype(spec, align=False, copy=True) -> np.dtype:
    if type(spec) is not str or not _NUMPY_SPEC.fullmatch(spec):
        raise Refusal(f"numpy.dtype({spec!r:.40}) is not a plain numeric dtype")
    return np.dtype(spec, bool(align), True)  # a private copy: BUILD then sets its byte order


def _np_reconstruct(subtype, shape, dtype) -> np.ndarray:
    if subtype is not NDARRAY or shape != (0,) or dtype != b"b":
        raise Refusal("numpy _reconstruct other than the (0,)-shaped stub NumPy pickles")
    return multiarray._reconstruct(np.ndarray, (0,), b"b")


def _np_scalar(dtype, data) -> np.generic:
    if not numeric(dtype) or type(data) is not bytes or len(data) != dtype.itemsize:
        raise Refusal("numpy scalar other than a numeric dtype with its bytes")
    return multiarray.scalar(dtype, data)


GLOBALS: Dict[tuple, Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("collections", "OrderedDict"): _ordered_dict,
    ("argparse", "Namespace"): argparse.Namespace,
    ("_io", "BytesIO"): io.BytesIO,
    ("_codecs", "encode"): _codecs_encode,
    ("builtins", "set"): _set,
    ("builtins", "frozenset"): _frozenset,
    ("__builtin__", "set"): _set,  # the names protocol 2 writes (Python 2 compatible)
    ("__builtin__", "frozenset"): _frozenset,
    ("numpy", "ndarray"): NDARRAY,
    ("numpy", "dtype"): _np_dtype,
}
for _m in ("numpy.core.multiarray", "numpy._core.multiarray"):
    GLOBALS[(_m, "_reconstruct")] = _np_reconstruct
    GLOBALS[(_m, "scalar")] = _np_scalar
del _m
# REDUCE may call only these functions (never a class: ``BytesIO(array)`` would copy it)
CALLABLE = tuple(v for v in GLOBALS.values() if callable(v) and not isinstance(v, type))
NEW = (argparse.Namespace, io.BytesIO)  # classes that NEWOBJ may instantiate (no arguments)
SIZED = (str, bytes, list, tuple, dict, set, frozenset)


def build_dtype(inst: np.dtype, state) -> None:
    """NumPy's pickled dtype state for a plain numeric type: only the byte order varies."""
    if type(state) is not tuple or len(state) != 8 or state[0] != 3 or \
            state[1] not in ("<", ">", "|", "=") or state[2:] != (None, None, None, -1, -1, 0):
        raise Refusal("BUILD state of a NumPy dtype must be that of a plain numeric dtype")
    inst.__setstate__(state)
