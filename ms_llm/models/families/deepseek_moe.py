"""What DeepSeek-V3 (``deepseek_v3``) and GLM-4.5 (``glm4_moe``) share: one router family
(sigmoid scores, ``e_score_correction_bias``, group-limited top-k, ``routed_scaling_factor``,
``norm_topk_prob``, shared experts, ``first_k_dense_replace`` dense layers, then MoE) and the
multi-token prediction layers (``num_nextn_predict_layers``), read from and written to HF."""
from __future__ import annotations

from typing import Mapping, Optional

from ..config import TransformerConfig
from ..yarn import hf_rope_scaling
from .common import decoder_fields, need


def moe_fields(hf: Mapping, source: str) -> dict:
    """The shared router/MoE fields of both families."""
    layers = int(need(hf, "num_hidden_layers", source))
    experts = int(need(hf, "n_routed_experts", source))
    moe_ffn = int(need(hf, "moe_intermediate_size", source))
    first_dense = int(hf.get("first_k_dense_replace") or 0)
    pattern = [int(i >= first_dense) for i in range(layers)]
    if not any(pattern):
        raise ValueError(f"{source}: first_k_dense_replace={first_dense} leaves no MoE layer")
    groups = int(hf.get("n_group") or 1)
    shared = int(hf.get("n_shared_experts") or 0)
    return dict(
        mlp_type="moe", num_moe_experts=experts,
        moe_router_topk=int(need(hf, "num_experts_per_tok", source)),
        moe_ffn_hidden_size=moe_ffn,
        moe_shared_expert_intermediate_size=moe_ffn * shared if shared else None,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=int(hf.get("topk_group") or 1) if groups > 1 else None,
        moe_router_norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        moe_layer_pattern=pattern)


def common_fields(hf: Mapping, source: str) -> dict:
    """Decoder + router fields; attention is the family's."""
    fields = decoder_fields(hf, source)
    for key in ("num_query_groups", "kv_channels"):
        del fields[key]
    fields["moe_router_load_balancing_type"] = "none"
    fields.update(moe_fields(hf, source))
    return fields


def layout_extras(hf: Mapping, source: str) -> dict:
    """MTP depths the config names (``ms_llm.checkpoint`` checks which the folder holds)."""
    return dict(mtp_layers=int(hf.get("num_nextn_predict_layers") or 0))


def is_router_family(c: TransformerConfig) -> bool:
    """A sigmoid router with expert bias and shared experts (without shared experts the model is
    left to the Qwen3-MoE export, which says what it lacks)."""
    return (c.mlp_type == "moe" and c.moe_router_score_function == "sigmoid"
            and c.moe_router_enable_expert_bias and bool(c.moe_shared_expert_intermediate_size))


def refusal(c: TransformerConfig, router_refusal: Optional[str] = None) -> Optional[str]:
    """What HF cannot express of ``c``. ``router_refusal``: the family's own router check (""
    when its router is fine: DeepSeek-V2's softmax one); None requires the sigmoid router with
    expert bias (DeepSeek-V3, GLM-4.5)."""
    if c.mlp_type != "moe":
        return "a dense MLP everywhere (both HF classes are MoE models)"
    if router_refusal:
        return router_refusal
    if router_refusal is None and (c.moe_router_score_function != "sigmoid"
                                   or not c.moe_router_enable_expert_bias):
        return "a router without sigmoid scores and expert bias"
    return shape_refusal(c)


def shape_refusal(c: TransformerConfig) -> Optional[str]:
    """The layer pattern, shared experts and MLP HF's DeepSeek classes can hold."""
    pattern = [int(c.is_moe_layer(i)) for i in range(c.num_layers)]
    first = pattern.index(1)
    if any(v == 0 for v in pattern[first:]):
        return f"MoE layers {pattern} (HF has first_k_dense_replace dense layers, then MoE)"
    shared = c.moe_shared_expert_intermediate_size or 0
    if shared % c.moe_ffn_hidden_size or c.moe_shared_expert_gate:
        return (f"shared experts of {shared} (HF: n_shared_experts x moe_intermediate_size "
                f"{c.moe_ffn_hidden_size}, no gate)")
    if not c.swiglu:
        return "a non-SwiGLU MLP"
    if c.multi_latent_attention and c.add_qkv_bias:
        return "QKV bias with MLA"
    return None


def common_to_hf(c: TransformerConfig, what: str, router_refusal: Optional[str] = None) -> dict:
    """The ``config.json`` fields both families write; ``what`` names the HF class in errors
    (``router_refusal``: see ``refusal``)."""
    why = refusal(c, router_refusal)
    if why:
        raise ValueError(f"export: HF {what} cannot express {why}")
    pattern = [int(c.is_moe_layer(i)) for i in range(c.num_layers)]
    groups = c.moe_router_num_groups or 1
    rope = {"rope_theta": c.rotary_base, "rope_type": "default"}
    scaling = hf_rope_scaling(c)
    if scaling:
        rope.update(scaling)
    return {
        "hidden_size": c.hidden_size, "intermediate_size": c.ffn_hidden_size,
        "moe_intermediate_size": c.moe_ffn_hidden_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads, "vocab_size": c.padded_vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.layernorm_epsilon, "hidden_act": "silu",
        "tie_word_embeddings": not c.untie_embeddings_and_output_weights,
        "n_routed_experts": c.num_moe_experts, "num_experts_per_tok": c.moe_router_topk,
        "n_shared_experts": (c.moe_shared_expert_intermediate_size or 0)
        // c.moe_ffn_hidden_size,
        "first_k_dense_replace": pattern.index(1), "n_group": groups,
        "topk_group": (c.moe_router_group_topk or 1) if groups > 1 else 1,
        "norm_topk_prob": bool(c.moe_router_norm_topk_prob),
        "routed_scaling_factor": float(c.moe_router_topk_scaling_factor or 1.0),
        "num_nextn_predict_layers": c.mtp_num_layers or 0, "rope_parameters": rope,
        "rope_theta": c.rotary_base, "torch_dtype": c.params_dtype,
    }


def router_megatron_args(c: TransformerConfig) -> dict:
    """Megatron's DeepSeek-router arguments the converter writes into a checkpoint's ``args``."""
    return dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_num_groups=c.moe_router_num_groups,
                moe_router_group_topk=c.moe_router_group_topk,
                moe_router_topk_scaling_factor=c.moe_router_topk_scaling_factor,
                moe_shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size)


TINY_MOE = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=3, num_attention_heads=4, n_shared_experts=1,
                n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
                routed_scaling_factor=1.5, max_position_embeddings=128, vocab_size=96,
                tie_word_embeddings=False)
