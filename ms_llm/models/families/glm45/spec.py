"""GLM-4.5's ``FamilySpec``: names, defaults, the converter's Megatron arguments, export guess
and test config."""
from __future__ import annotations

from ...registry import FamilySpec
from .. import deepseek_moe as DS
from .hf import from_hf, to_hf

SPEC = FamilySpec(
    name="glm45", hf_model_type="glm4_moe", hf_architecture="Glm4MoeForCausalLM",
    from_hf=from_hf, to_hf=to_hf,
    defaults=dict(add_qkv_bias=True, mlp_type="moe", moe_router_score_function="sigmoid",
                  moe_router_enable_expert_bias=True, moe_router_load_balancing_type="none",
                  layernorm_epsilon=1e-5, rotary_percent=0.5),
    aliases=("glm4_moe", "glm4.5", "glm-4.5"), megatron_names=("glm45", "glm45-moe", "glm4_moe"),
    mindspeed_specs=("glm45", "glm4_moe"),
    megatron_args=DS.router_megatron_args,
    claims=lambda c: not c.multi_latent_attention and DS.is_router_family(c), claim_order=20,
    layout_extras=DS.layout_extras,
    tiny_hf=dict(DS.TINY_MOE, num_key_value_heads=2, head_dim=24, n_group=1, topk_group=1,
                 partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True,
                 rms_norm_eps=1e-5))
