"""Gradient accumulation and global-norm clipping (torch.nn.utils.clip_grad_norm_ semantics)."""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

from mindspore import Tensor, mint


def accumulate(acc: Optional[List[Tensor]], grads: Sequence[Tensor]) -> List[Tensor]:
    if acc is None:
        return list(grads)
    return [a + g for a, g in zip(acc, grads)]


def global_norm(grads: Sequence[Tensor]) -> float:
    total = None
    for g in grads:
        s = mint.sum(g * g)
        total = s if total is None else total + s
    return math.sqrt(float(total.asnumpy())) if total is not None else 0.0


def clip_(grads: List[Tensor], max_norm: float, norm: float) -> List[Tensor]:
    """Scale by max_norm / (norm + 1e-6) when the norm exceeds max_norm (torch's rule)."""
    if max_norm <= 0 or norm <= max_norm:
        return grads
    coef = max_norm / (norm + 1e-6)
    return [g * coef for g in grads]
