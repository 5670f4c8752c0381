"""YaRN RoPE scaling: the frequencies and attention factor, read from and written to HF configs.

Why one module: the same numbers must reach the training forward, inference and the HF export,
and they must be Hugging Face's (``modeling_rope_utils._compute_yarn_parameters``), because a
YaRN checkpoint is only right with the frequencies it was trained with:

* ``inv_freq = interp * (1 - e) + extrap * e`` with ``extrap = base^(-2i/d)``,
  ``interp = extrap / factor`` and ``e = 1 - ramp(i)``, a linear ramp from 0 to 1 between the
  correction dims of ``beta_fast`` and ``beta_slow`` rotations over the original context
  (``d * ln(L_orig / (2 pi beta)) / (2 ln base)``, floored / ceiled when ``truncate``);
* ``attention_factor`` (given, else ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``
  when both are set, else ``mscale(factor) = 0.1 ln(factor) + 1``) multiplies cos and sin, so
  every attention logit is scaled by its square, as HF applies it.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import numpy as np

from .config import TransformerConfig

_HF_KEYS = {  # TransformerConfig field -> HF rope_scaling key
    "yarn_rotary_scaling_factor": "factor",
    "yarn_original_max_position_embeddings": "original_max_position_embeddings",
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
    "yarn_mscale": "mscale",
    "yarn_mscale_all_dim": "mscale_all_dim",
    "yarn_attention_factor": "attention_factor",
    "yarn_correction_range_round_to_int": "truncate",
}


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_parameters(dim: int, base: float, factor: float, original_max_position_embeddings: int,
                    beta_fast: float = 32.0, beta_slow: float = 1.0,
                    mscale: Optional[float] = None, mscale_all_dim: Optional[float] = None,
                    attention_factor: Optional[float] = None,
                    truncate: bool = True) -> Tuple[np.ndarray, float]:
    """``(inv_freq [dim/2] float64, attention_factor)`` of YaRN (see the module docstring)."""
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
        else:
            attention_factor = _mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(base)))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001   # HF's guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    interpolation = extrapolation / factor
    keep = 1.0 - ramp                        # 1: high frequency, kept as trained
    return interpolation * (1.0 - keep) + extrapolation * keep, float(attention_factor)


def rope_frequencies(config: TransformerConfig) -> Tuple[Optional[np.ndarray], float]:
    """``(inv_freq or None for plain RoPE, attention_factor)`` of ``config``."""
    c = config
    if c.position_embedding_type != "yarn":
        return None, 1.0
    original = c.yarn_original_max_position_embeddings or c.max_position_embeddings
    factor = c.yarn_rotary_scaling_factor
    if factor is None:
        factor = c.max_position_embeddings / original
    return yarn_parameters(c.rotary_dim, c.rotary_base, factor, original, c.yarn_beta_fast,
                           c.yarn_beta_slow, c.yarn_mscale, c.yarn_mscale_all_dim,
                           c.yarn_attention_factor, c.yarn_correction_range_round_to_int)


def rope_fields_from_hf(hf: dict, source: str = "config.json") -> dict:
    """TransformerConfig fields (``rotary_base``, ``position_embedding_type``, ``yarn_*``) of an
    HF config: ``rope_parameters`` (transformers 5, which also holds ``rope_theta``) or
    ``rope_scaling`` with ``rope_type`` / legacy ``type``. Other scaling types raise."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type")) or "default"
    out = {"rotary_base": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if rope_type == "default":
        return out
    if rope_type != "yarn":
        raise ValueError(f"{source}: rope_scaling {rope!r} is not supported yet (only yarn)")
    out["position_embedding_type"] = "yarn"
    for field, key in _HF_KEYS.items():
        if rope.get(key) is not None:
            out[field] = rope[key]
    # Phi3-style configs keep the pretraining length at the top level; HF gives it priority.
    if hf.get("original_max_position_embeddings") is not None:
        out["yarn_original_max_position_embeddings"] = hf["original_max_position_embeddings"]
    # HF reads beta_fast / beta_slow with ``or``: 0 or null means the default.
    for field in ("yarn_beta_fast", "yarn_beta_slow"):
        if field in out and not out[field]:
            del out[field]
    return out


def hf_rope_scaling(config: TransformerConfig) -> Optional[dict]:
    """The ``rope_scaling`` dict of ``config`` for an HF ``config.json`` (None for plain RoPE).
    ``original_max_position_embeddings`` is always written (transformers 5 requires it)."""
    c = config
    if c.position_embedding_type != "yarn":
        return None
    out = {"rope_type": "yarn"}
    defaults = TransformerConfig.__dataclass_fields__
    for field, key in _HF_KEYS.items():
        value = getattr(c, field)
        if value is not None and value != defaults[field].default:
            out[key] = value
    out["original_max_position_embeddings"] = (c.yarn_original_max_position_embeddings
                                               or c.max_position_embeddings)
    if "factor" not in out:
        out["factor"] = c.max_position_embeddings / out["original_max_position_embeddings"]
    return out
