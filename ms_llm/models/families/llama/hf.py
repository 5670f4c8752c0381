"""Llama's ``config.json`` <-> TransformerConfig: RMSNorm, SwiGLU, RoPE, GQA, no biases."""
from __future__ import annotations

from typing import Mapping

from ...config import TransformerConfig
from ..common import check_heads, decoder_fields, decoder_to_hf, dense_only, refuse_attention_bias


def from_hf(hf: Mapping, source: str = "config.json") -> TransformerConfig:
    refuse_attention_bias(hf, source)
    check_heads(hf, source)
    return TransformerConfig(**decoder_fields(hf, source), qk_layernorm=False, add_qkv_bias=False)


def to_hf(c: TransformerConfig) -> dict:
    why = dense_only(c, "Llama") or (
        "QK-norm or QKV bias (HF Llama has neither)" if c.qk_layernorm or c.add_qkv_bias
        else None)
    if why:
        raise ValueError(f"export: HF Llama cannot express {why}")
    return decoder_to_hf(c, "llama", "LlamaForCausalLM")
