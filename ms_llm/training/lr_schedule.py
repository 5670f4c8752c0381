"""Megatron's OptimizerParamScheduler shapes: linear warmup, then cosine/linear decay to min_lr."""
from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, decay_steps: int,
          style: str = "cosine") -> float:
    """Learning rate for optimizer step ``step`` (1-based, as Megatron counts iterations)."""
    if warmup_steps > 0 and step <= warmup_steps:
        return lr * step / warmup_steps
    if style == "constant":
        return lr
    if step > decay_steps:
        return min_lr
    span = max(decay_steps - warmup_steps, 1)
    ratio = (step - warmup_steps) / span
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:
        raise ValueError(f"training.lr_decay_style: unknown style {style!r}")
    return min_lr + coeff * (lr - min_lr)
