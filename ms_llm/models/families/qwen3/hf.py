"""Qwen3's ``config.json`` <-> TransformerConfig: Llama with QK-norm and an explicit
``head_dim``."""
from __future__ import annotations

from typing import Mapping

from ...config import TransformerConfig
from ..common import check_heads, decoder_fields, decoder_to_hf, dense_only, refuse_attention_bias


def from_hf(hf: Mapping, source: str = "config.json") -> TransformerConfig:
    refuse_attention_bias(hf, source)
    check_heads(hf, source)
    return TransformerConfig(**decoder_fields(hf, source), qk_layernorm=True, add_qkv_bias=False)


def qwen3_attention_refusal(c: TransformerConfig) -> str:
    if not c.qk_layernorm or c.add_qkv_bias:
        return "attention without QK-norm or with QKV bias"
    return ""


def to_hf(c: TransformerConfig) -> dict:
    why = dense_only(c, "Qwen3") or qwen3_attention_refusal(c)
    if why:
        raise ValueError(f"export: HF Qwen3 cannot express {why}")
    return decoder_to_hf(c, "qwen3", "Qwen3ForCausalLM")
