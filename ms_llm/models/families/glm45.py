"""GLM-4.5 (HF ``Glm4MoeForCausalLM``): grouped-query attention with partial rotary
(``partial_rotary_factor``), QKV bias (``attention_bias``) and optional QK-norm
(``use_qk_norm``), and the DeepSeek router (``deepseek_moe``)."""
from __future__ import annotations

from typing import Mapping

from ..config import TransformerConfig
from ..registry import FamilySpec, register_family
from . import deepseek_moe as DS


def partial_rotary_factor(hf: Mapping) -> float:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) or 1.0)


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


SPEC = register_family(FamilySpec(
    name="glm45", hf_model_type="glm4_moe", hf_architecture="Glm4MoeForCausalLM",
    from_hf=from_hf, to_hf=to_hf,
    defaults=dict(add_qkv_bias=True, mlp_type="moe", moe_router_score_function="sigmoid",
                  moe_router_enable_expert_bias=True, moe_router_load_balancing_type="none",
                  layernorm_epsilon=1e-5, rotary_percent=0.5),
    aliases=("glm4_moe", "glm4.5", "glm-4.5"), megatron_names=("glm45", "glm45-moe", "glm4_moe"),
    megatron_args=DS.router_megatron_args,
    claims=lambda c: not c.multi_latent_attention and DS.is_router_family(c), claim_order=20,
    layout_extras=DS.layout_extras,
    tiny_hf=dict(DS.TINY_MOE, num_key_value_heads=2, head_dim=24, n_group=1, topk_group=1,
                 partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True,
                 rms_norm_eps=1e-5)))
