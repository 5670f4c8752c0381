"""GLM-4.5's ``FamilySpec``: names, defaults, the converter's Megatron arguments, export guess,
test config and qualify row."""
from __future__ import annotations

from ...registry import FamilySpec, Qualify
from .. import deepseek_moe as DS
from ..llama.spec import TINY_ARGS
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
                 rms_norm_eps=1e-5),
    # GLM-4.5's attention (QKV bias, QK-norm, half-width rotary) and sigmoid-routed MoE with an
    # expert bias and a shared expert, on tiny_moe.yaml's data at tiny sizes
    qualify=Qualify("glm45", "tiny_moe.yaml",
                    ("--model.family", "glm45", *TINY_ARGS, "--model.qk_layernorm", "true",
                     "--model.num_moe_experts", "4", "--model.moe_router_topk", "2",
                     "--model.moe_ffn_hidden_size", "32",
                     "--model.moe_shared_expert_intermediate_size", "32",
                     "--model.moe_router_bias_update_rate", "0.01")))
