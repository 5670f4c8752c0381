"""Multi-head latent attention (DeepSeek-V2/V3, ``ms_llm.models.mla``), the full attention of
a model with ``model.multi_latent_attention``."""
from __future__ import annotations

from .attention import softmax_attention_bytes, softmax_attention_flops
from .registry import MixerKind, register_mixer


def _validate(c) -> None:
    for key in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        if getattr(c, key) < 1:
            raise ValueError(f"model.{key} ({getattr(c, key)}) must be >= 1")
    if c.q_lora_rank is not None and c.q_lora_rank < 1:
        raise ValueError(f"model.q_lora_rank ({c.q_lora_rank}) must be >= 1 or null")
    if c.qk_pos_emb_head_dim % 2:
        raise ValueError(f"model.qk_pos_emb_head_dim ({c.qk_pos_emb_head_dim}) must be "
                         f"even for RoPE")
    if c.qk_layernorm or c.add_qkv_bias:
        raise ValueError("model.multi_latent_attention: qk_layernorm / add_qkv_bias do not "
                         "apply (MLA normalises its compressed q and kv)")


def _weights(c) -> int:
    h, nh = c.hidden_size, c.num_attention_heads
    qk, pe, v = c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim
    q = h * nh * (qk + pe) if c.q_lora_rank is None else \
        h * c.q_lora_rank + c.q_lora_rank * nh * (qk + pe)
    return q + h * (c.kv_lora_rank + pe) + c.kv_lora_rank * nh * (qk + v) + nh * v * h


def _build(config):
    from ..mla import MLASelfAttention
    return MLASelfAttention(config)


def _twin_widths(c, unit: int) -> dict:
    """The low ranks and head dims of the plan's twin (the rope part stays even)."""
    return dict(q_lora_rank=None if c.q_lora_rank is None else unit, kv_lora_rank=unit,
                qk_head_dim=unit, qk_pos_emb_head_dim=2 * unit, v_head_dim=unit)


MLA = register_mixer(MixerKind(
    name="mla", title="multi-head latent attention", build=_build, validate=_validate,
    twin_widths=_twin_widths,
    selected_by=lambda c: c.multi_latent_attention,
    # the activation copies were measured on fused-QKV attention; MLA's q/k/v per head have
    # the same widths (kv_channels = qk + rope)
    activation_bytes=softmax_attention_bytes, weights_per_token=_weights,
    mixing_flops_per_token=lambda c, s: softmax_attention_flops(
        c, s, c.qk_head_dim + c.qk_pos_emb_head_dim, c.v_head_dim)))
