"""Reading ``torch.save`` zip checkpoints without torch, refusing whatever it does not understand.

Why so strict: ``data.pkl`` is a pickle, i.e. a small program, and a checkpoint may come from
anywhere. It runs on a pure-Python unpickler (the C one cannot intercept ``BUILD``, and sizes
its memo by the largest index a ``PUT`` names) in which every opcode that calls, builds or
fills an object is checked:

* globals resolve only from an allow-list (tensor rebuild functions, storage types, dtypes,
  ``OrderedDict``, ``argparse.Namespace``, ``BytesIO``, a few Megatron enums, NumPy array
  reconstruction) and nothing else is ever imported; ``REDUCE``/``NEWOBJ`` call only those;
* ``BUILD`` (``__setstate__``) works only on Namespace/OrderedDict/BytesIO instances and NumPy
  arrays/dtypes, with plain-data state; item opcodes only on the matching built-in type; so no
  file can alter a class, a function or a shared object such as ``GlobalRef("torch", "bfloat16")``;
* sizes (storage element counts, tensor views, NumPy array data) are checked against the zip
  member's declared size, and that against the file's length, before anything is allocated;
  objects the pickle can copy cheaply (sets, bytes, OrderedDicts) are charged to a budget
  proportional to the pickle's length, and the finished object graph must be acyclic, at most
  ``MAX_DEPTH`` deep and (counting shared parts every time they are reached) proportional to
  the pickle's length, so walking it cannot explode either.

Every refusal raises ``TorchFormatError`` with one line naming the file and the problem; any
other error that malformed input provokes (zip, struct, pickle, recursion, memory) is wrapped
into it.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import io
import math
import pickle
from typing import Any, Callable, Dict, Iterator

import numpy as np

from .archive import Archive, LazyTensor, Storage, one_line
from .format import (MEGATRON_ENUMS, STORAGE_DTYPES, TORCH_DTYPE_NAMES,
                     ForbiddenGlobalError, GlobalCall, GlobalRef, TorchFormatError)
from .allowed_globals import CALLABLE, GLOBALS, NEW, SIZED, Refusal, build_dtype, numeric

MAX_DEPTH = 100  # nesting of containers; real checkpoints use about 8
_OD = collections.OrderedDict


# --------------------------------------------------------------------------------------------
# Plain data: the only object graphs a file may produce
# --------------------------------------------------------------------------------------------

_LEAVES = (type(None), bool, int, float, complex, str, bytes, LazyTensor, Storage, GlobalRef,
           io.BytesIO)


class GraphCheck:
    """Checks that an object graph is plain data: known types only, acyclic, at most
    ``MAX_DEPTH`` deep, and at most ``max_nodes`` nodes when shared parts are counted every time
    they are reached (so code that walks it as a tree stays linear in the file). Shared parts
    are checked once; the memo holds them so their ids stay valid."""

    def __init__(self, max_nodes: int):
        self.max_nodes = max_nodes
        self._sizes: Dict[int, tuple] = {}
        self._active: set = set()

    def size(self, obj, depth: int = 0) -> int:
        kind = type(obj)
        if kind in _LEAVES or isinstance(obj, (np.dtype, np.generic)):
            return 1
        if kind is np.ndarray:
            if not numeric(obj.dtype):
                raise Refusal(f"NumPy array of dtype {obj.dtype}")
            return 1
        known = self._sizes.get(id(obj))
        if known is not None:
            return known[1]
        if id(obj) in self._active:
            raise Refusal("the object graph has a cycle")
        if depth >= MAX_DEPTH:
            raise Refusal(f"containers nested deeper than {MAX_DEPTH}")
        self._active.add(id(obj))
        total = 1 + sum(self.size(c, depth + 1) for c in _children(obj))
        self._active.discard(id(obj))
        if total > self.max_nodes:
            raise Refusal(f"the object graph unfolds to more than {self.max_nodes} nodes")
        self._sizes[id(obj)] = (obj, total)
        return total


def _children(obj) -> list:
    kind = type(obj)
    if kind in (list, tuple, set, frozenset):
        return list(obj)
    if kind is dict:
        return [x for kv in obj.items() for x in kv]
    if kind is _OD:
        return [x for kv in obj.items() for x in kv] + list(vars(obj).values())
    if kind is argparse.Namespace:
        return list(vars(obj).values())
    if kind is GlobalCall:
        return list(obj.args)
    raise Refusal(f"a {kind.__name__} is not checkpoint data")


# --------------------------------------------------------------------------------------------
# The unpickler
# --------------------------------------------------------------------------------------------

def _refused(name: str) -> Callable:
    def load(self):
        raise Refusal(f"pickle opcode {name} is not used by torch.save (refused)")
    return load


class RestrictedUnpickler(pickle._Unpickler):
    """Unpickles ``data.pkl`` of ``archive`` with the checks described in the module docstring.
    ``budget`` bounds what REDUCE/BUILD may copy (elements or bytes)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes, archive: Archive):
        super().__init__(io.BytesIO(data))
        self.archive = archive
        self.storages: Dict[str, Storage] = {}
        self.budget = Budget(2 * len(data) + 4096, "the pickle copies more data than it holds")
        self.plain = GraphCheck(4 * len(data) + 4096)

    def charge(self, obj) -> None:
        """Count a copy of ``obj`` (its length, for sized built-ins) before it is made."""
        self.budget.charge(len(obj) if type(obj) in SIZED else 1)

    def find_class(self, module: str, name: str):
        key = (module, name)
        if key in GLOBALS:
            return GLOBALS[key]
        if (module == "torch" and (name in STORAGE_DTYPES or name in TORCH_DTYPE_NAMES)) or \
                key in MEGATRON_ENUMS:
            return GlobalRef(module, name)
        raise ForbiddenGlobalError(f"{self.archive.path}: pickle asks for the global "
                                   f"{_printable(module)}.{_printable(name)}, which a "
                                   f"checkpoint does not need (refused; nothing was executed)")

    def persistent_load(self, pid) -> Storage:
        if not (type(pid) is tuple and len(pid) == 5 and type(pid[0]) is str and
                pid[0] == "storage"):
            raise Refusal("unsupported persistent id (not a storage)")
        _, stype, key, _location, numel = pid
        if type(stype) is not GlobalRef or stype.module != "torch" or \
                stype.name not in STORAGE_DTYPES:
            raise Refusal(f"unsupported storage type {_describe(stype)}")
        if type(key) is not str or type(numel) is not int or numel < 0:
            raise Refusal("storage key must be a string and its size a non-negative int")
        if key not in self.storages:
            self.storages[key] = Storage(self.archive, key, STORAGE_DTYPES[stype.name], numel)
        return self.storages[key]

    def load_reduce(self):
        args = self.stack.pop()
        func = self.stack[-1]
        if type(args) is not tuple:
            raise Refusal("REDUCE arguments are not a tuple")
        enum = type(func) is GlobalRef and (func.module, func.name) in MEGATRON_ENUMS
        if not enum and not any(func is f for f in CALLABLE):
            raise Refusal(f"calling {_describe(func)} is refused")
        self.charge(args[0] if args else None)
        self.stack[-1] = func(*args)

    def load_newobj(self):
        args = self.stack.pop()
        self.stack[-1] = self._new(self.stack[-1], args, {})

    def load_newobj_ex(self):
        kwargs = self.stack.pop()
        args = self.stack.pop()
        self.stack[-1] = self._new(self.stack[-1], args, kwargs)

    def _new(self, cls, args, kwargs):
        if not any(cls is c for c in NEW) or type(args) is not tuple or args or \
                type(kwargs) is not dict or kwargs:
            raise Refusal(f"NEWOBJ of {_describe(cls)} is refused")
        return cls()

    def load_build(self):
        state = self.stack.pop()
        inst = self.stack[-1]
        kind = type(inst)
        if kind in (argparse.Namespace, _OD):
            self._build_attrs(inst, state)
        elif kind is io.BytesIO:
            self._build_bytesio(inst, state)
        elif kind is np.ndarray:
            self._build_ndarray(inst, state)
        elif isinstance(inst, np.dtype):
            build_dtype(inst, state)
        else:
            raise Refusal(f"BUILD (__setstate__) on {_describe(inst)} is refused")

    def _build_attrs(self, inst, state) -> None:
        """Namespace attributes / OrderedDict ``_metadata``: plain data under names that do not
        shadow anything the class defines."""
        if type(state) is not dict or not all(type(k) is str and not hasattr(type(inst), k)
                                             for k in state):
            raise Refusal(f"BUILD state of a {type(inst).__name__} must map new attribute "
                           f"names to data")
        self.charge(state)
        self.plain.size(state)
        vars(inst).update(state)

    def _build_bytesio(self, inst: io.BytesIO, state) -> None:
        if type(state) is not tuple or len(state) != 3 or type(state[0]) is not bytes or \
                type(state[1]) is not int or not 0 <= state[1] <= len(state[0]) or \
                state[2] is not None or inst.getbuffer().nbytes:
            raise Refusal("BUILD state of a BytesIO must be (bytes, position, None)")
        self.charge(state[0])
        inst.__setstate__(state)

    def _build_ndarray(self, inst: np.ndarray, state) -> None:
        """NumPy's pickled array: (1, shape, dtype, fortran, raw bytes), sizes matching."""
        ok = type(state) is tuple and len(state) == 5 and state[0] == 1 and inst.size == 0
        shape = state[1] if ok else None
        ok = ok and type(shape) is tuple and len(shape) <= 32 and \
            all(type(n) is int and n >= 0 for n in shape) and numeric(state[2]) and \
            type(state[3]) is bool and type(state[4]) is bytes
        if not ok or len(state[4]) != math.prod(shape) * state[2].itemsize:
            raise Refusal("BUILD state of a NumPy array must be (1, shape, numeric dtype, "
                           "fortran, bytes of exactly that size)")
        self.charge(state[4])
        inst.__setstate__(state)

    def load_append(self):
        value = self.stack.pop()
        self._target("APPEND", list).append(value)

    def load_appends(self):
        items = self.pop_mark()
        self._target("APPENDS", list).extend(items)

    def load_setitem(self):
        value = self.stack.pop()
        key = self.stack.pop()
        self._target("SETITEM", dict, _OD)[key] = value

    def load_setitems(self):
        items = self.pop_mark()
        target = self._target("SETITEMS", dict, _OD)
        if len(items) % 2:
            raise Refusal("SETITEMS with an odd number of items")
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    def load_additems(self):
        items = self.pop_mark()
        self._target("ADDITEMS", set).update(items)

    def _target(self, opcode: str, *kinds: type):
        obj = self.stack[-1]
        if type(obj) not in kinds:
            raise Refusal(f"{opcode} on {_describe(obj)} is refused")
        return obj

    for _op, _fn in ((pickle.REDUCE, load_reduce), (pickle.NEWOBJ, load_newobj),
                     (pickle.NEWOBJ_EX, load_newobj_ex), (pickle.BUILD, load_build),
                     (pickle.APPEND, load_append), (pickle.APPENDS, load_appends),
                     (pickle.SETITEM, load_setitem), (pickle.SETITEMS, load_setitems),
                     (pickle.ADDITEMS, load_additems)):
        dispatch[_op[0]] = _fn
    for _name in ("INST", "OBJ", "EXT1", "EXT2", "EXT4", "BYTEARRAY8", "NEXT_BUFFER",
                  "READONLY_BUFFER", "PERSID"):
        dispatch[getattr(pickle, _name)[0]] = _refused(_name)
    del _op, _fn, _name


def _printable(text: str) -> str:
    """A name from the file as one short line (escapes instead of newlines)."""
    return text.encode("unicode_escape").decode("ascii")[:60]


def _describe(obj) -> str:
    """A short, safe description of a file-made object for an error message (no recursion into
    it, whose repr could be huge or deeply nested)."""
    if type(obj) in (str, bytes, int, float, bool, type(None), GlobalRef):
        return repr(obj)[:60]
    return f"a {type(obj).__name__}"


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

class TorchCheckpoint:
    """An open torch file: ``obj`` holds ``LazyTensor`` leaves; close (or use ``with``) after."""

    def __init__(self, path: str):
        self.archive = Archive(path)
        try:
            self.obj = self._unpickle()
        except BaseException:
            self.archive.close()
            raise

    def _unpickle(self):
        with refusals(self.archive.path, "data.pkl"):
            byteorder = self.archive.record("byteorder", optional=True)
            if byteorder not in (None, b"little"):
                raise Refusal(f"byteorder {byteorder!r:.20} is not supported (only "
                              f"little-endian)")
            pkl = self.archive.record("data.pkl")
            obj = RestrictedUnpickler(pkl, self.archive).load()
            GraphCheck(4 * len(pkl) + 4096).size(obj)
        return obj

    def close(self) -> None:
        self.archive.close()

    def __enter__(self) -> "TorchCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def refusals(path: str, what: str) -> Iterator[None]:
    """Any error that malformed input provokes becomes one ``TorchFormatError`` line naming
    ``path`` (our own ``TorchFormatError``s pass through: they name it already)."""
    try:
        yield
    except TorchFormatError:
        raise
    except Refusal as e:
        raise TorchFormatError(f"{path}: {what}: {one_line(e)}") from None
    except Exception as e:  # noqa: BLE001  (pickle/zip/struct/memory/recursion errors alike)
        raise TorchFormatError(f"{path}: {what} is malformed ({type(e).__name__}: "
                               f"{one_line(e)})") from None


class Budget:
    """A countdown of the elements or bytes a file may make the reader copy or allocate;
    running out raises ``Refusal(what)``."""

    def __init__(self, amount: int, what: str):
        self.left, self.what = amount, what

    def charge(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise Refusal(self.what)


def materialize(obj, budget: Budget, memo: Dict[int, Any]):
    """``obj`` with ``LazyTensor`` leaves read into arrays; a shared part stays shared (read
    once). ``budget`` bounds the tensor bytes: many views of one storage could otherwise make
    a small file produce many copies of it."""
    if id(obj) in memo:
        return memo[id(obj)]
    kind = type(obj)
    if kind is LazyTensor:
        budget.charge(obj.nbytes)
        out = obj.numpy()
    elif kind in (dict, _OD):
        out = kind((k, materialize(v, budget, memo)) for k, v in obj.items())
    elif kind in (list, tuple):
        out = kind(materialize(v, budget, memo) for v in obj)
    elif kind is argparse.Namespace:
        out = argparse.Namespace(**{k: materialize(v, budget, memo)
                                    for k, v in vars(obj).items()})
    else:
        return obj
    memo[id(obj)] = out
    return out


def load(path: str, lazy: bool = False):
    """Load a ``torch.save`` zip file. ``lazy=False`` returns plain Python/NumPy objects;
    ``lazy=True`` returns a ``TorchCheckpoint`` whose ``obj`` has ``LazyTensor`` leaves (keep it
    open while reading tensors). Raises ``TorchFormatError`` for anything it does not accept."""
    ckpt = TorchCheckpoint(path)
    if lazy:
        return ckpt
    try:
        with refusals(path, "tensor data"):
            budget = Budget(4 * ckpt.archive.size + (1 << 20), "its tensor views add up to "
                            "more bytes than the file could hold (many views of one storage)")
            return materialize(ckpt.obj, budget, {})
    finally:
        ckpt.close()
