"""DeepSeek-V3's ``FamilySpec``: names, defaults, the converter's Megatron arguments, export
guess, test config and qualify row."""
from __future__ import annotations

from ...config import TransformerConfig
from ...registry import FamilySpec, Qualify
from .. import deepseek_moe as DS
from .hf import config_for_layout, from_hf, layout_extras, to_hf


def megatron_args(c: TransformerConfig) -> dict:
    """Megatron-Core's MLA names and MindSpeed-LLM's (--multi-head-latent-attention ...)."""
    return dict(DS.router_megatron_args(c),
                multi_latent_attention=True, q_lora_rank=c.q_lora_rank,
                kv_lora_rank=c.kv_lora_rank, qk_head_dim=c.qk_head_dim,
                qk_pos_emb_head_dim=c.qk_pos_emb_head_dim, v_head_dim=c.v_head_dim,
                multi_head_latent_attention=True, qk_nope_head_dim=c.qk_head_dim,
                qk_rope_head_dim=c.qk_pos_emb_head_dim)


QUALIFY_ARGS = ("--model.hidden_size", "64", "--model.ffn_hidden_size", "96",
                "--model.q_lora_rank", "32", "--model.kv_lora_rank", "16", "--model.qk_head_dim",
                "16", "--model.qk_pos_emb_head_dim", "8", "--model.v_head_dim", "16",
                "--model.moe_ffn_hidden_size", "32",
                "--model.moe_shared_expert_intermediate_size", "32",
                "--model.moe_router_bias_update_rate", "0.01")

SPEC = FamilySpec(
    name="deepseek-v3", hf_model_type="deepseek_v3", hf_architecture="DeepseekV3ForCausalLM",
    from_hf=from_hf, to_hf=to_hf,
    defaults=dict(multi_latent_attention=True, mlp_type="moe",
                  moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                  moe_router_load_balancing_type="seq_aux_loss", layernorm_epsilon=1e-6),
    aliases=("deepseek_v3", "deepseekv3", "deepseek3"),
    megatron_names=("deepseek3", "deepseek-v3", "deepseek_v3"), megatron_args=megatron_args,
    mindspeed_specs=("deepseek",),
    claims=lambda c: c.multi_latent_attention, claim_order=10,
    layout_extras=layout_extras, from_hf_for_layout=config_for_layout,
    tiny_hf=dict(DS.TINY_MOE, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48,
                 qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=4,
                 topk_group=2, rms_norm_eps=1e-6),
    qualify=Qualify("deepseek-v3", "deepseek_v3_proxy.yaml", QUALIFY_ARGS, num_layer_list="1,2"))
