"""The vocabulary shared by the torch ``.pt`` reader and writer: error types, the storage and
dtype tables, and ``GlobalRef``, the stand-in for a torch global such as ``torch.bfloat16``.

Why a module of its own: the reader (``reader``) and the writer (``torch_pickle``)
both need these names, and the reader must not depend on the writer.
"""
from __future__ import annotations

import pickle
from typing import Dict, Tuple

import ml_dtypes
import numpy as np

__all__ = ["TorchFormatError", "ForbiddenGlobalError", "STORAGE_DTYPES", "GlobalRef",
           "GlobalCall", "torch_dtype", "contiguous_strides"]


class TorchFormatError(ValueError):
    """Every refusal of the reader: the file is not a torch zip checkpoint it can read safely
    (truncated, corrupt, legacy format, or asking for something a checkpoint never needs)."""


class ForbiddenGlobalError(TorchFormatError, pickle.UnpicklingError):
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
STORAGE_BY_DTYPE = {v: k for k, v in STORAGE_DTYPES.items()}
TORCH_DTYPE_NAMES = frozenset((
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
    "bool", "float", "double", "half", "long", "int", "short"))
# Megatron enums that appear in the ``args`` Namespace of real checkpoints (args.model_type, ...).
MEGATRON_ENUMS = frozenset({
    ("megatron.core.enums", "ModelType"), ("megatron.core.transformer.enums", "AttnBackend"),
    ("megatron.core.transformer.enums", "AttnMaskType"),
    ("megatron.core.transformer.enums", "AttnType"),
    ("megatron.core.transformer.enums", "LayerType"), ("megatron.model.enums", "ModelType"),
})

_INTERNED: Dict[Tuple[str, str], "GlobalRef"] = {}


class GlobalRef:
    """A global (``module.name``) that pickles as itself without importing the module.

    One instance per name, so a pickle memoizes it like the real object (our files match
    ``torch.save``'s byte for byte). Immutable, because every file this process reads or writes
    shares the instance: nothing a file does may change what a later write names.
    """

    __slots__ = ("module", "name")

    def __new__(cls, module: str, name: str) -> "GlobalRef":
        key = (str(module), str(name))
        ref = _INTERNED.get(key)
        if ref is None:
            ref = object.__new__(cls)
            object.__setattr__(ref, "module", key[0])
            object.__setattr__(ref, "name", key[1])
            ref = _INTERNED.setdefault(key, ref)
        return ref

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"GlobalRef {self!r} is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"GlobalRef {self!r} is immutable")

    def __call__(self, *args) -> "GlobalCall":
        return GlobalCall(self, args)

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"

    def __reduce__(self):  # only reached by a foreign pickler; keeps identity semantics
        return (GlobalRef, (self.module, self.name))

    def __copy__(self) -> "GlobalRef":
        return self

    def __deepcopy__(self, memo) -> "GlobalRef":
        return self


class GlobalCall:
    """``ref(*args)`` kept symbolic, e.g. ``megatron.core.enums.ModelType(1)``; immutable like
    the ``GlobalRef`` it names."""

    __slots__ = ("ref", "args")

    def __init__(self, ref: GlobalRef, args: tuple):
        object.__setattr__(self, "ref", ref)
        object.__setattr__(self, "args", tuple(args))

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError("GlobalCall is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("GlobalCall is immutable")

    def __eq__(self, other) -> bool:
        return isinstance(other, GlobalCall) and (self.ref, self.args) == (other.ref, other.args)

    __hash__ = None  # equal calls compare equal; args may be unhashable

    def __repr__(self) -> str:
        return f"{self.ref!r}{self.args!r}"


def torch_dtype(name: str) -> GlobalRef:
    """The pickled form of ``torch.<name>`` (e.g. ``args.params_dtype = torch.bfloat16``)."""
    if name not in TORCH_DTYPE_NAMES:
        raise ValueError(f"unknown torch dtype name {name!r}")
    return GlobalRef("torch", name)


def contiguous_strides(shape: tuple) -> tuple:
    """Row-major element strides of ``shape`` (what a contiguous torch tensor records)."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))
