"""dtype names as PyTorch users write them, mapped to MindSpore and NumPy."""
from __future__ import annotations

import mindspore as ms
import numpy as np

float32 = ms.float32
float16 = ms.float16
bfloat16 = ms.bfloat16
int32 = ms.int32
int64 = ms.int64
bool_ = ms.bool_

_BY_NAME = {
    "float32": float32, "fp32": float32, "float": float32,
    "float16": float16, "fp16": float16, "half": float16,
    "bfloat16": bfloat16, "bf16": bfloat16,
    "int32": int32, "int64": int64, "bool": bool_,
}


def to_ms_dtype(dtype) -> "ms.dtype":
    """Accept a MindSpore dtype, a NumPy dtype or a torch-style name ("bf16", "float32")."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        try:
            return _BY_NAME[dtype.lower()]
        except KeyError:
            raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_BY_NAME)}") from None
    if isinstance(dtype, ms.dtype.Type):
        return dtype
    return _from_numpy(np.dtype(dtype))


def _from_numpy(dt: np.dtype):
    if dt.name == "bfloat16":
        return bfloat16
    mapping = {np.float32: float32, np.float16: float16, np.int32: int32, np.int64: int64,
               np.bool_: bool_}
    for k, v in mapping.items():
        if dt == np.dtype(k):
            return v
    raise ValueError(f"unsupported numpy dtype {dt}")


def is_floating(dtype) -> bool:
    return dtype in (float32, float16, bfloat16, ms.float64)


PARAM_DTYPES = ("float32", "bfloat16", "float16")


def param_dtype(name: str):
    """A model's parameter dtype from its name: a floating type only (an integer or boolean
    model runs, but every weight is truncated and the output is garbage)."""
    dt = to_ms_dtype(name)
    if not is_floating(dt):
        raise ValueError(f"dtype {name!r} is not a floating type (parameters: "
                         f"{', '.join(PARAM_DTYPES)})")
    return dt
