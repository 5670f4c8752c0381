"""GLM-4.5's ``config.json`` <-> TransformerConfig: grouped-query attention with partial rotary,
QKV bias and optional QK-norm, and the DeepSeek router (``deepseek_moe``)."""
from __future__ import annotations

from typing import Mapping

from ...config import TransformerConfig
from .. import deepseek_moe as DS
from ..common import partial_rotary_factor


def from_hf(hf: Mapping, source: str = "config.json") -> TransformerConfig:
    fields = DS.common_fields(hf, source)
    heads = fields["num_attention_heads"]
    return TransformerConfig(
        **fields,
        num_query_groups=int(hf.get("num_key_value_heads") or heads),
        kv_channels=int(hf.get("head_dim") or fields["hidden_size"] // heads),
        add_qkv_bias=bool(hf.get("attention_bias", False)),
        qk_layernorm=bool(hf.get("use_qk_norm", False)),
        rotary_percent=partial_rotary_factor(hf))


def to_hf(c: TransformerConfig) -> dict:
    cfg = DS.common_to_hf(c, "GLM-4.5")
    if c.add_bias_linear:
        raise ValueError("export: HF GLM-4.5 has no o_proj / MLP biases (add_bias_linear)")
    cfg["rope_parameters"]["partial_rotary_factor"] = c.rotary_percent
    cfg.update(model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"],
               num_key_value_heads=c.num_query_groups, head_dim=c.kv_channels,
               attention_bias=bool(c.add_qkv_bias), use_qk_norm=bool(c.qk_layernorm),
               partial_rotary_factor=c.rotary_percent)
    return cfg
