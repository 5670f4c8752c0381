"""Qwen3.5's ``config.json`` <-> TransformerConfig: Qwen3-Next's hybrid fields with a dense MLP
(``hybrid_fields`` / ``hybrid_refusal`` are shared with Qwen3.5-MoE); a vision-language config is
refused."""
from __future__ import annotations

from typing import Mapping, Optional

from ...config import TransformerConfig
from ..common import (check_heads, decoder_fields, need, partial_rotary_factor,
                      refuse_attention_bias)
from ..qwen3_next.hf import LINEAR_KEYS, hybrid_to_hf, layer_types_from_hf


def refuse_vision_language(hf: Mapping, source: str) -> None:
    if "text_config" in hf:
        raise ValueError(f"{source}: a Qwen3.5 vision-language config (text_config, keys under "
                         f"model.language_model.) is not built; save the text model as "
                         f"Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM")


def hybrid_fields(hf: Mapping, source: str) -> dict:
    """The TransformerConfig fields Qwen3.5 dense and MoE share (everything but the MLP)."""
    refuse_vision_language(hf, source)
    refuse_attention_bias(hf, source)
    check_heads(hf, source)
    fields = decoder_fields(hf, source)
    fields.update({k: int(need(hf, k, source)) for k in LINEAR_KEYS})
    return dict(fields, qk_layernorm=True, add_qkv_bias=False,
                layer_types=layer_types_from_hf(hf, source), attention_output_gate=True,
                layernorm_zero_centered_gamma=True, rotary_percent=partial_rotary_factor(hf))


def hybrid_refusal(c: TransformerConfig) -> Optional[str]:
    if not (c.attention_output_gate and c.layernorm_zero_centered_gamma and c.qk_layernorm):
        return "a model without gated attention, zero-centred norms and QK-norm"
    if c.layer_types is None:
        return "a model without layer_types"
    return None


def from_hf(hf: Mapping, source: str = "config.json") -> TransformerConfig:
    return TransformerConfig(**hybrid_fields(hf, source))


def to_hf(c: TransformerConfig) -> dict:
    why = hybrid_refusal(c) or (f"mlp_type {c.mlp_type!r} (HF Qwen3.5 is dense; use qwen35-moe)"
                                if c.mlp_type != "dense" else None)
    if why:
        raise ValueError(f"export: HF Qwen3.5 cannot express {why}")
    return hybrid_to_hf(c, "qwen3_5_text", "Qwen3_5ForCausalLM")
