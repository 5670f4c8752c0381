"""DeepSeek-V2's ``FamilySpec``: names (MindSpeed-LLM's ``deepseek2`` / ``deepseek2-lite``),
defaults, the converter's Megatron arguments, export guess and test config."""
from __future__ import annotations

from ...config import TransformerConfig
from ...registry import FamilySpec
from .. import deepseek_moe as DS
from ..deepseek_v3.spec import megatron_args as v3_megatron_args
from .hf import from_hf, to_hf


def megatron_args(c: TransformerConfig) -> dict:
    """DeepSeek-V3's MLA names with V2's softmax router."""
    return dict(v3_megatron_args(c), moe_router_score_function="softmax",
                moe_router_enable_expert_bias=False,
                moe_router_pre_softmax=bool(c.moe_router_pre_softmax))


def claims(c: TransformerConfig) -> bool:
    """MLA with a softmax router (DeepSeek-V3's is sigmoid)."""
    return bool(c.multi_latent_attention and c.mlp_type == "moe"
                and c.moe_router_score_function == "softmax")


SPEC = FamilySpec(
    name="deepseek-v2", hf_model_type="deepseek_v2", hf_architecture="DeepseekV2ForCausalLM",
    from_hf=from_hf, to_hf=to_hf,
    defaults=dict(multi_latent_attention=True, mlp_type="moe",
                  moe_router_score_function="softmax", moe_router_pre_softmax=True,
                  moe_router_load_balancing_type="aux_loss", layernorm_epsilon=1e-6),
    aliases=("deepseek_v2", "deepseekv2"),
    megatron_names=("deepseek2", "deepseek2-lite", "deepseek-v2", "deepseek_v2"),
    megatron_args=megatron_args, mindspeed_specs=("deepseek",),
    claims=claims, claim_order=9,
    layout_extras=DS.layout_extras,
    # V2-Lite's attention (no query LoRA), shrunk; the router scaled by 1.5 to test the factor
    tiny_hf=dict(DS.TINY_MOE, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
                 qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, topk_method="greedy",
                 norm_topk_prob=False, rms_norm_eps=1e-6))
