"""The largest attention logit of each query head (``scale * q.k`` over the keys the mask lets
a query see), which QK-clip (``ms_llm.training.qk_clip``) and ``log_max_attention_logit`` read
after a step: Megatron-Core gets it from TransformerEngine's ``return_max_logit``; here it is
one extra ``q k^T`` product per attention call, computed only while recording is on."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
from mindspore import Tensor, mint, ops

from ms_llm.compat import float32

_MASKED = -3.0e38   # below every real logit: a masked key never wins the max


def max_attention_logits(q: Tensor, k: Tensor, attention_mask: Optional[Tensor] = None,
                         scale: Optional[float] = None) -> Tensor:
    """``[nh]`` fp32: per query head, the max over batch, queries and visible keys of
    ``scale * q.k`` (q ``[b, nh, s, d]``, k ``[b, ng, s, d]``; ``attention_mask`` bool
    ``[b or 1, 1, s, s]`` True = masked, else causal). No gradient flows through it."""
    q, k = ops.stop_gradient(q).astype(float32), ops.stop_gradient(k).astype(float32)
    b, nh, s, d = q.shape
    ng, sk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = mint.matmul(q.reshape(b, ng, (nh // ng) * s, d), k.swapaxes(-1, -2))
    scores = scores.reshape(b, ng, nh // ng, s, sk) * scale
    if attention_mask is None:
        masked = Tensor(np.triu(np.ones((s, sk), np.bool_), 1 + sk - s))
    else:
        masked = attention_mask.reshape(attention_mask.shape[0], 1, 1, s, sk)
    scores = mint.where(masked, Tensor(_MASKED, float32), scores)
    return scores.amax(axis=(0, 3, 4)).reshape(nh)
