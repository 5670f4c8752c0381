"""Read Hugging Face model folders without torch: ``config.json`` + single or sharded safetensors."""
from __future__ import annotations

import json
import os
from typing import Dict, Tuple

import numpy as np


def read_hf_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: not a Hugging Face model folder (no such directory)")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{cfg_path}: missing (a Hugging Face folder needs config.json)")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path}: invalid JSON ({e})") from None


def safetensors_files(path: str) -> list:
    """The weight files of a folder: those named by ``model.safetensors.index.json``, or the one
    ``model.safetensors``."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' object")
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.isfile(os.path.join(path, name)):
                raise FileNotFoundError(f"{os.path.join(path, name)}: listed in {index} but missing")
        return [os.path.join(path, n) for n in files]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
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
            raise ValueError(f"{file}: cannot read safetensors ({e})") from None
        for k, v in tensors.items():
            if k in out:
                raise ValueError(f"{file}: tensor {k!r} also appears in another shard")
            out[k] = v
    return out


def read_hf_folder(path: str) -> Tuple[dict, Dict[str, np.ndarray]]:
    return read_hf_config(path), read_hf_weights(path)
