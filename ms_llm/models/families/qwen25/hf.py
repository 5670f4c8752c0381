"""Qwen2 / Qwen2.5's ``config.json`` <-> TransformerConfig: Llama with q/k/v biases and no
``head_dim`` key."""
from __future__ import annotations

from typing import Mapping

from ...config import TransformerConfig
from ..common import check_heads, decoder_fields, decoder_to_hf, dense_only


def from_hf(hf: Mapping, source: str = "config.json") -> TransformerConfig:
    check_heads(hf, source)
    # Qwen2/2.5 always have q/k/v biases (attention_bias is not read by its modeling code).
    return TransformerConfig(**decoder_fields(hf, source), qk_layernorm=False, add_qkv_bias=True)


def to_hf(c: TransformerConfig) -> dict:
    why = dense_only(c, "Qwen2") or (
        "QK-norm or attention without QKV bias (HF Qwen2 always has q/k/v biases)"
        if c.qk_layernorm or not c.add_qkv_bias else None)
    if why:
        raise ValueError(f"export: HF Qwen2 cannot express {why}")
    if c.kv_channels * c.num_attention_heads != c.hidden_size:
        raise ValueError(f"export: Qwen2 config.json has no head_dim; kv_channels "
                         f"{c.kv_channels} must equal hidden_size / heads")
    cfg = decoder_to_hf(c, "qwen2", "Qwen2ForCausalLM")
    del cfg["head_dim"], cfg["attention_bias"]
    return cfg
