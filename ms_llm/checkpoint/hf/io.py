"""Read and write Hugging Face model folders without torch: ``config.json`` + single or sharded
safetensors (``HFReader`` / ``HFWriter`` stream one tensor at a time for the converter)."""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
from typing import Dict, Optional, Tuple

import ml_dtypes
import numpy as np


def read_hf_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: not a Hugging Face model folder (no such directory)")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{cfg_path}: missing (a Hugging Face folder needs config.json)")
    from ms_llm.validation import read_json_object, validate_hf_config
    return validate_hf_config(read_json_object(cfg_path), cfg_path)


# The files MindSpeed-LLM's mg -> hf copies from ``--hf-cfg-dir``: JSON configs (tokenizer,
# generation, special tokens), sentencepiece models, chat templates, BPE merges and the remote
# code of ``trust_remote_code`` models.
_SIDE_FILES = re.compile(r"^(?:.*\.json|.*\.model(?:\.\w+)?|.*\.jinja|merges\.txt|"
                         r"(?:modeling|configuration|tokenization)_\w+\.py|sample_finetune\.py)$")


def copy_hf_side_files(src: str, dst: str) -> list:
    """Copy an HF folder's tokenizer, generation config and other non-weight files into ``dst``
    (what the converted weights need to be used as that model). ``config.json`` is not copied
    (the converter writes it from the same fields) nor are weight indexes (they describe the
    source's shards) nor files ``dst`` already has. Returns the names copied."""
    copied = []
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if not _SIDE_FILES.match(name) or name == "config.json" or name.endswith(".index.json") \
                or not os.path.isfile(path) or os.path.exists(os.path.join(dst, name)):
            continue
        shutil.copyfile(path, os.path.join(dst, name))
        copied.append(name)
    return copied


def safetensors_files(path: str) -> list:
    """The weight files of a folder: those named by ``model.safetensors.index.json``, or the one
    ``model.safetensors``."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        from ms_llm.validation import read_json_object
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' object")
        files = sorted(set(weight_map.values()))
        bad = [n for n in files if not isinstance(n, str) or os.path.basename(n) != n]
        if bad:
            raise ValueError(f"{index}: weight_map names {bad[0]!r}, not a file of this folder")
        for name in files:
            if not os.path.isfile(os.path.join(path, name)):
                raise FileNotFoundError(f"{os.path.join(path, name)}: listed in {index} but missing")
        return [os.path.join(path, n) for n in files]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    if any(os.path.isfile(os.path.join(path, n)) for n in ("pytorch_model.bin",
                                                           "pytorch_model.bin.index.json")):
        raise FileNotFoundError(f"{path}: only pytorch_model.bin weights; ms-llm reads "
                                f"safetensors (re-save the model with safe_serialization)")
    raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")


def read_hf_weights(path: str) -> Dict[str, np.ndarray]:
    """All tensors of the folder as NumPy arrays in their stored dtype (bf16 via ml_dtypes)."""
    from safetensors.numpy import load_file  # ml_dtypes supplies bfloat16 for numpy
    import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy before safetensors asks)

    out: Dict[str, np.ndarray] = {}
    for file in safetensors_files(path):
        try:
            tensors = load_file(file)
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"{file}: cannot read safetensors ({e}; truncated or not a "
                             f"safetensors file?)") from None
        for k, v in tensors.items():
            if k in out:
                raise ValueError(f"{file}: tensor {k!r} also appears in another shard")
            out[k] = v
    return out


def read_hf_folder(path: str) -> Tuple[dict, Dict[str, np.ndarray]]:
    return read_hf_config(path), read_hf_weights(path)


# --------------------------------------------------------------------------------------------
# Streaming safetensors access (used by the converter): tensors are read one at a time and
# written into pre-planned shards, so a conversion never holds the whole model.
# --------------------------------------------------------------------------------------------

_ST_DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32),
              "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
              "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
              "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_)}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def _header_entry(path: str, name: str, t) -> Tuple[np.dtype, tuple, int, int]:
    """``(dtype, shape, begin, end)`` of one header entry, refusing malformed fields."""
    if not isinstance(t, dict) or t.get("dtype") not in _ST_DTYPES:
        raise ValueError(f"{path}: tensor {name!r} has unsupported dtype "
                         f"{t.get('dtype') if isinstance(t, dict) else t!r}")
    shape, offs = t.get("shape"), t.get("data_offsets")
    ints = (lambda xs: isinstance(xs, list) and all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in xs))
    if not ints(shape) or not ints(offs) or len(offs) != 2:
        raise ValueError(f"{path}: tensor {name!r}: shape {shape!r} / data_offsets {offs!r} "
                         f"are not lists of non-negative integers")
    dt = _ST_DTYPES[t["dtype"]]
    b, e = offs
    if e < b or e - b != int(np.prod(shape, dtype=np.int64)) * dt.itemsize:
        raise ValueError(f"{path}: tensor {name!r} byte range does not match its shape")
    return dt, tuple(shape), b, e


def check_byte_ranges(path: str, ranges: Dict[str, Tuple[int, int]], data_size: int) -> None:
    """Every tensor's ``[begin, end)`` lies inside the data section and no two overlap (one
    tensor aliasing another's bytes is how a crafted file changes two weights at once; the
    ``safetensors`` library refuses it too)."""
    last_end, last = 0, None
    for name, (b, e) in sorted(ranges.items(), key=lambda kv: (kv[1][0], kv[1][1])):
        if e > data_size:
            raise ValueError(f"{path}: truncated (tensor {name!r} needs bytes up to "
                             f"{e}, the data section has {data_size})")
        if b < last_end and e > b:
            raise ValueError(f"{path}: tensor {name!r} bytes [{b}, {e}) overlap tensor "
                             f"{last!r} (ends at {last_end})")
        if e > last_end:
            last_end, last = e, name


class SafetensorsFile:
    """Header of one ``.safetensors`` file plus positional reads of single tensors."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{path}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100_000_000:
                raise ValueError(f"{path}: truncated or corrupt safetensors file (header length "
                                 f"{n}, file size {size})")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}: corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start = 8 + n
        self.tensors: Dict[str, Tuple[np.dtype, tuple, int, int]] = {}
        for name, t in header.items():
            self.tensors[name] = _header_entry(path, name, t)
        check_byte_ranges(path, {k: v[2:] for k, v in self.tensors.items()},
                          size - self.data_start)

    def get(self, name: str) -> np.ndarray:
        dt, shape, b, e = self.tensors[name]
        out = np.empty(shape, dtype=dt)
        view = memoryview(out.reshape(-1).view(np.uint8))
        fd = os.open(self.path, os.O_RDONLY)
        try:
            done = 0
            while done < e - b:
                got = os.preadv(fd, [view[done:]], self.data_start + b + done)
                if got <= 0:
                    raise ValueError(f"{self.path}: truncated while reading {name!r}")
                done += got
        finally:
            os.close(fd)
        return out


class HFReader:
    """A Hugging Face folder opened for streaming: config plus per-tensor reads."""

    def __init__(self, path: str):
        self.path = path
        self.config = read_hf_config(path)
        self.files = [SafetensorsFile(f) for f in safetensors_files(path)]
        self._where: Dict[str, SafetensorsFile] = {}
        for f in self.files:
            for name in f.tensors:
                if name in self._where:
                    raise ValueError(f"{f.path}: tensor {name!r} also appears in "
                                     f"{self._where[name].path}")
                self._where[name] = f

    def names(self) -> list:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def dtype(self, name: str) -> np.dtype:
        return self._where[name].tensors[name][0]

    def shape(self, name: str) -> tuple:
        return self._where[name].tensors[name][1]

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise KeyError(f"{self.path}: missing tensor {name!r}")
        return self._where[name].get(name)


def parse_size(text) -> int:
    """``"5GB"`` -> 5e9 bytes (HF's ``max_shard_size`` convention; ``GiB`` is binary)."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper()
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6,
             "GB": 10**9, "TB": 10**12, "B": 1}
    for u, mult in units.items():
        if s.endswith(u):
            num = s[: -len(u)].strip()
            break
    else:
        num, mult = s, 1
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"max_shard_size: cannot parse {text!r} (e.g. 5GB, 500MB)") from None
    if value <= 0:
        raise ValueError(f"max_shard_size: must be positive, got {text!r}")
    return int(value * mult)


class HFWriter:
    """Write a HF folder from a known list of ``(name, shape, dtype)``: shards are planned up
    front (HF's greedy rule: a new shard when the next tensor would pass ``max_shard_size``),
    each shard's header is written first and ``add`` writes each tensor at its planned offset,
    in any order. Single shard -> ``model.safetensors``; else ``model-0000k-of-0000n`` + index.
    """

    def __init__(self, path: str, specs, max_shard_size="5GB", config: Optional[dict] = None):
        self.path = path
        limit = parse_size(max_shard_size)
        shards, cur, cur_size = [], [], 0
        for name, shape, dtype in specs:
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            if cur and cur_size + nbytes > limit:
                shards.append(cur)
                cur, cur_size = [], 0
            cur.append((name, tuple(int(s) for s in shape), np.dtype(dtype), nbytes))
            cur_size += nbytes
        if cur:
            shards.append(cur)
        n = len(shards)
        self.files = ["model.safetensors"] if n == 1 else \
            [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        self.plan: Dict[str, Tuple[int, int, tuple, np.dtype]] = {}
        os.makedirs(path, exist_ok=True)
        self._fds = []
        total = 0
        for k, shard in enumerate(shards):
            header, off = {"__metadata__": {"format": "pt"}}, 0
            for name, shape, dtype, nbytes in shard:
                header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape),
                                "data_offsets": [off, off + nbytes]}
                off += nbytes
            blob = json.dumps(header, separators=(",", ":")).encode()
            blob += b" " * ((-len(blob)) % 8)
            fd = os.open(os.path.join(path, self.files[k]), os.O_CREAT | os.O_TRUNC | os.O_WRONLY,
                         0o644)
            os.write(fd, struct.pack("<Q", len(blob)) + blob)
            os.ftruncate(fd, 8 + len(blob) + off)
            self._fds.append(fd)
            for name, shape, dtype, nbytes in shard:
                self.plan[name] = (k, 8 + len(blob) + header[name]["data_offsets"][0], shape,
                                   dtype)
            total += off
        self.total_size = total
        self._written = set()
        self.config = config

    def add(self, name: str, array: np.ndarray) -> None:
        if name not in self.plan:
            raise KeyError(f"{self.path}: tensor {name!r} is not in the planned output")
        k, offset, shape, dtype = self.plan[name]
        if tuple(array.shape) != shape or array.dtype != dtype:
            raise ValueError(f"{self.path}: tensor {name!r} is {array.dtype}{list(array.shape)}, "
                             f"planned {dtype}{list(shape)}")
        data = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        done = 0
        while done < len(data):
            done += os.pwrite(self._fds[k], data[done:], offset + done)
        self._written.add(name)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        missing = [n for n in self.plan if n not in self._written]
        if missing:
            raise RuntimeError(f"{self.path}: tensors never written: {missing[:5]}")
        if len(self.files) > 1:
            index = {"metadata": {"total_size": self.total_size},
                     "weight_map": {n: self.files[self.plan[n][0]] for n in sorted(self.plan)}}
            with open(os.path.join(self.path, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
                f.write("\n")
        if self.config is not None:
            with open(os.path.join(self.path, "config.json"), "w") as f:
                json.dump(self.config, f, indent=2, sort_keys=True)
                f.write("\n")

    def abort(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
