"""Gradient accumulation and global-norm clipping (torch.nn.utils.clip_grad_norm_ semantics)."""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

from mindspore import Tensor, mint


def accumulate(acc: Optional[List[Tensor]], grads: Sequence[Tensor]) -> List[Tensor]:
    if acc is None:
        return list(grads)
    return [a + g for a, g in zip(acc, grads)]


def sum_of_squares(grads: Sequence[Tensor]) -> Tensor:
    """Sum of squares of all gradients (also used inside the jitted forward/backward graph)."""
    total = mint.sum(grads[0] * grads[0])
    for g in grads[1:]:
        total = total + mint.sum(g * g)
    return total


def global_norm(grads: Sequence[Tensor]) -> float:
    return math.sqrt(float(sum_of_squares(grads).asnumpy())) if grads else 0.0


def clip_(grads: List[Tensor], max_norm: float, norm: float) -> List[Tensor]:
    """Scale by max_norm / (norm + 1e-6) when the norm exceeds max_norm (torch's rule)."""
    if max_norm <= 0 or norm <= max_norm:
        return grads
    coef = max_norm / (norm + 1e-6)
    return [g * coef for g in grads]
