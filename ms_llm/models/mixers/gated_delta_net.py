"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear-attention layers, ``ms_llm.models.
gated_delta_net``): no softmax core, no ``[s, s]`` scores.

Its memory-plan term: per micro-batch of ``T`` tokens, what the backward of the layer and of the
chunked delta rule (``gated_delta_rule.chunk_gated_delta_rule``, chunk ``C``) keep, in units of
one fp32 tensor of that shape (``COPIES``):

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

The copy counts are the kernel's tensor counts, scaled by one factor (``FIT``) fitted on a
measured tiny hybrid run (tests/planning/test_qwen3_next_plan.py).
"""
from __future__ import annotations

import math

from .registry import ActivationBytes, MixerKind, register_mixer

FP32 = 4
COPIES = {
    "proj": 1.0,        # [T, qkvz + ba] projection outputs
    "conv": 2.0,        # [T, C_conv] x (K + 2): input, shifted products, SiLU
    "key": 10.0,        # [T, hv, dk]
    "value": 8.0,       # [T, hv, dv]
    "chunk": 3.0,       # [T, hv, C] x (4 + 2 log2 C): the per-chunk C x C matrices
    "state": 3.0,       # [T / C, hv, dk, dv]
}
FIT = 1.2               # one factor over the counts above: measured 0.566 GB vs 0.496 planned
                        # at FIT 1 (tests/planning/test_qwen3_next_plan.py, its first config)


def _validate(c) -> None:
    if c.linear_num_value_heads % c.linear_num_key_heads:
        raise ValueError(f"model.linear_num_value_heads ({c.linear_num_value_heads}) must be "
                         f"a multiple of model.linear_num_key_heads ({c.linear_num_key_heads})")
    if c.multi_latent_attention:
        raise ValueError("model.layer_types: gated_delta_net layers with MLA are not built")


def activation_bytes(c, b: int, s: int, tp: int = 1) -> ActivationBytes:
    """One Gated DeltaNet layer and micro-batch of ``b`` sequences of ``s`` tokens (``tp``:
    key-head groups split over tensor parallel ranks)."""
    tokens = b * s
    hk, hv = c.linear_num_key_heads // tp, c.linear_num_value_heads // tp
    dk, dv, ch = c.linear_key_head_dim, c.linear_value_head_dim, c.linear_chunk_size
    conv = 2 * hk * dk + hv * dv
    proj = 2 * hk * dk + 2 * hv * dv + 2 * hv
    padded = -(-s // ch) * ch * b
    kept = (COPIES["proj"] * tokens * proj
            + COPIES["conv"] * tokens * conv * (c.linear_conv_kernel_dim + 2) / 2
            + COPIES["key"] * padded * hv * dk + COPIES["value"] * padded * hv * dv
            + COPIES["chunk"] * padded * hv * ch * (4 + 2 * math.log2(ch)) / 2
            + COPIES["state"] * (padded // ch) * hv * dk * dv)
    # the backward of one chunk step at a time: its C x C and state-sized gradients
    transient = int(FP32 * (COPIES["chunk"] * b * hv * ch * ch
                            + COPIES["state"] * b * hv * dk * dv))
    return ActivationBytes(projections=0, core=int(FIT * FP32 * kept), transient=transient,
                           rerun_transient=transient)


def _weights(c) -> int:
    """``in_proj_qkvz``, ``in_proj_ba``, the depthwise ``conv1d`` (``K`` taps per channel) and
    ``out_proj``."""
    h = c.hidden_size
    key, value = c.linear_num_key_heads * c.linear_key_head_dim, \
        c.linear_num_value_heads * c.linear_value_head_dim
    return (h * (2 * key + 2 * value) + h * 2 * c.linear_num_value_heads
            + (2 * key + value) * c.linear_conv_kernel_dim + value * h)


def _mixing_flops(c, seq_length: int) -> int:
    """The recurrent form's state work per token and value head: the state update ``k^T v``
    and the read ``q S`` (``dk * dv`` multiply-accumulates each), times 3 for forward +
    backward; linear in the sequence, so ``seq_length`` does not enter."""
    return 3 * 2 * 2 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim


def _build(config):
    from ..gated_delta_net import GatedDeltaNet
    return GatedDeltaNet(config)


GATED_DELTA_NET = register_mixer(MixerKind(
    name="gated_delta_net", title="Gated DeltaNet", build=_build, validate=_validate,
    core_attention=False, megatron_training_checkpoints=False,
    twin_widths=lambda c, unit: dict(linear_key_head_dim=unit, linear_value_head_dim=unit),
    activation_bytes=activation_bytes, weights_per_token=_weights,
    mixing_flops_per_token=_mixing_flops,
    layout_sizes=lambda c: (c.linear_num_key_heads, c.linear_num_value_heads,
                            c.linear_key_head_dim, c.linear_value_head_dim,
                            c.linear_conv_kernel_dim)))
