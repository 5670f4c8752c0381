"""``ms-llm plan``'s activation term of a Gated DeltaNet layer (Qwen3-Next / Qwen3.5 hybrid
layers), which keeps no ``[s, s]`` scores but chunk-sized and state-sized tensors instead.

Per micro-batch of ``T`` tokens, what the backward of ``ms_llm.models.gated_delta_net`` and the
chunked delta rule (``gated_delta_rule.chunk_gated_delta_rule``, chunk ``C``) keep, in units of
one fp32 tensor of that shape (``ACT_GDN``):

* ``[T, width]`` of the projections and the short convolution: ``in_proj_qkvz`` / ``in_proj_ba``
  outputs, the convolution's input, its ``K`` shifted products and SiLU output;
* ``[T, hv, dk]``: q and k broadcast to the value heads, L2-normalised, ``k * beta``, the
  decayed keys, ``w``, ``q_dec``, ``k_dec``;
* ``[T, hv, dv]``: v, ``v * beta``, ``u``, the per-chunk new values and outputs, the gated
  RMSNorm's output and gate;
* ``[T, hv, C]``: each chunk's ``C x C`` matrices (decay, ``k k^T``, the unit-lower inverse's
  ``log2 C`` doubling products, the intra-chunk scores);
* ``[T / C, hv, dk, dv]``: the state carried between chunks (decayed, updated) per chunk;
* the recurrent state ``[b, hv, dk, dv]`` and conv buffer ``[b, K - 1, C_conv]`` a cache holds
  exist only in decoding, not here.

The copy counts are the kernel's tensor counts, scaled by one factor fitted on a measured
tiny hybrid run (tests/test_qwen3_next_plan.py).
"""
from __future__ import annotations

import math
from typing import Tuple

from ms_llm.models.config import TransformerConfig

FP32 = 4
ACT_GDN = {
    "proj": 1.0,        # [T, qkvz + ba] projection outputs
    "conv": 2.0,        # [T, C_conv] x (K + 2): input, shifted products, SiLU
    "key": 10.0,        # [T, hv, dk]
    "value": 8.0,       # [T, hv, dv]
    "chunk": 3.0,       # [T, hv, C] x (4 + 2 log2 C): the per-chunk C x C matrices
    "state": 3.0,       # [T / C, hv, dk, dv]
}
FIT = 1.2               # one factor over the counts above: measured 0.566 GB vs 0.496 planned
                        # at FIT 1 (tests/test_qwen3_next_plan.py, its first config)


def gdn_activation_bytes(c: TransformerConfig, b: int, s: int, tp: int = 1) -> Tuple[int, int]:
    """(kept through forward, transient while its backward runs) of one Gated DeltaNet token
    mixer for one micro-batch of ``b`` sequences of ``s`` tokens (``tp``: heads split over
    tensor parallel ranks)."""
    tokens = b * s
    hk, hv = c.linear_num_key_heads // tp, c.linear_num_value_heads // tp
    dk, dv, ch = c.linear_key_head_dim, c.linear_value_head_dim, c.linear_chunk_size
    conv = 2 * hk * dk + hv * dv
    proj = 2 * hk * dk + 2 * hv * dv + 2 * hv
    padded = -(-s // ch) * ch * b
    kept = (ACT_GDN["proj"] * tokens * proj
            + ACT_GDN["conv"] * tokens * conv * (c.linear_conv_kernel_dim + 2) / 2
            + ACT_GDN["key"] * padded * hv * dk + ACT_GDN["value"] * padded * hv * dv
            + ACT_GDN["chunk"] * padded * hv * ch * (4 + 2 * math.log2(ch)) / 2
            + ACT_GDN["state"] * (padded // ch) * hv * dk * dv)
    # the backward of one chunk step at a time: its C x C and state-sized gradients
    transient = ACT_GDN["chunk"] * b * hv * ch * ch + ACT_GDN["state"] * b * hv * dk * dv
    return int(FIT * FP32 * kept), int(FP32 * transient)
