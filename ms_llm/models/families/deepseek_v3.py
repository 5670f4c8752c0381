"""DeepSeek-V3 (HF ``DeepseekV3ForCausalLM``): multi-head latent attention (Megatron-Core's
MLATransformerConfig names: ``qk_head_dim`` = HF ``qk_nope_head_dim``, ``qk_pos_emb_head_dim`` =
``qk_rope_head_dim``) and the DeepSeek router (``deepseek_moe``)."""
from __future__ import annotations

from typing import Mapping

from ..config import TransformerConfig
from ..registry import FamilySpec, Qualify, register_family
from . import deepseek_moe as DS
from .common import need


def mla_fields(hf: Mapping, source: str) -> dict:
    q_lora = hf.get("q_lora_rank")
    return dict(multi_latent_attention=True,
                q_lora_rank=int(q_lora) if q_lora else None,
                kv_lora_rank=int(need(hf, "kv_lora_rank", source)),
                qk_head_dim=int(need(hf, "qk_nope_head_dim", source)),
                qk_pos_emb_head_dim=int(need(hf, "qk_rope_head_dim", source)),
                v_head_dim=int(need(hf, "v_head_dim", source)),
                mla_rope_interleaved=bool(hf.get("rope_interleave", True)),
                kv_channels=int(hf["qk_nope_head_dim"]) + int(hf["qk_rope_head_dim"]),
                num_query_groups=int(hf["num_attention_heads"]))


def _config(hf: Mapping, source: str) -> TransformerConfig:
    return TransformerConfig(**DS.common_fields(hf, source), **mla_fields(hf, source))


def from_hf(hf: Mapping, source: str = "config.json") -> TransformerConfig:
    if hf.get("attention_bias"):
        # add_bias_linear would also put biases on the MLPs (and experts have none).
        raise ValueError(f"{source}: attention_bias=true is not supported for deepseek_v3 "
                         f"models yet (ms-llm convert handles its tensors)")
    return _config(hf, source)


def layout_extras(hf: Mapping, source: str) -> dict:
    """MTP depths and the MLA linear biases (``attention_bias``), which the converter carries
    though the model has no place for them."""
    return dict(DS.layout_extras(hf, source), attn_bias=bool(hf.get("attention_bias", False)))


def to_hf(c: TransformerConfig) -> dict:
    cfg = DS.common_to_hf(c, "DeepSeek-V3")
    cfg.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
               num_key_value_heads=c.num_attention_heads, q_lora_rank=c.q_lora_rank,
               kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_head_dim,
               qk_rope_head_dim=c.qk_pos_emb_head_dim, v_head_dim=c.v_head_dim,
               rope_interleave=bool(c.mla_rope_interleaved),
               attention_bias=bool(c.add_bias_linear))
    return cfg


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

SPEC = register_family(FamilySpec(
    name="deepseek-v3", hf_model_type="deepseek_v3", hf_architecture="DeepseekV3ForCausalLM",
    from_hf=from_hf, to_hf=to_hf,
    defaults=dict(multi_latent_attention=True, mlp_type="moe",
                  moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                  moe_router_load_balancing_type="seq_aux_loss", layernorm_epsilon=1e-6),
    aliases=("deepseek_v3", "deepseekv3", "deepseek3"),
    megatron_names=("deepseek3", "deepseek-v3", "deepseek_v3"), megatron_args=megatron_args,
    claims=lambda c: c.multi_latent_attention, claim_order=10,
    layout_extras=layout_extras, from_hf_for_layout=_config,
    tiny_hf=dict(DS.TINY_MOE, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48,
                 qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=4,
                 topk_group=2, rms_norm_eps=1e-6),
    qualify=Qualify("deepseek-v3", "deepseek_v3_proxy.yaml", QUALIFY_ARGS)))
