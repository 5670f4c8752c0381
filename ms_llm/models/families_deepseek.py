"""HF ``config.json`` -> TransformerConfig for DeepSeek-V3 (``deepseek_v3``) and GLM-4.5
(``glm4_moe``): one router family (sigmoid scores, ``e_score_correction_bias``, group-limited
top-k, ``routed_scaling_factor``, ``norm_topk_prob``, shared experts, ``first_k_dense_replace``
dense layers); DeepSeek-V3 has multi-head latent attention, GLM-4.5 grouped-query attention with
partial rotary, QKV bias and optional QK-norm."""
from __future__ import annotations

from .config import TransformerConfig

HF_MODEL_TYPES = {"deepseek_v3": "deepseek-v3", "glm4_moe": "glm45"}
FAMILIES = {
    "deepseek-v3": dict(multi_latent_attention=True, mlp_type="moe",
                        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                        moe_router_load_balancing_type="seq_aux_loss", layernorm_epsilon=1e-6),
    "glm45": dict(add_qkv_bias=True, mlp_type="moe", moe_router_score_function="sigmoid",
                  moe_router_enable_expert_bias=True, moe_router_load_balancing_type="none",
                  layernorm_epsilon=1e-5, rotary_percent=0.5),
}
ALIASES = {"deepseek_v3": "deepseek-v3", "deepseekv3": "deepseek-v3", "deepseek3": "deepseek-v3",
           "glm4_moe": "glm45", "glm4.5": "glm45", "glm-4.5": "glm45"}


def _need(hf: dict, key: str, source: str):
    if key not in hf or hf[key] is None:
        raise ValueError(f"{source}: missing key {key!r} (needed for {hf.get('model_type')})")
    return hf[key]


def moe_fields_from_hf(hf: dict, source: str) -> dict:
    """The shared router/MoE fields of both families."""
    layers = int(_need(hf, "num_hidden_layers", source))
    experts = int(_need(hf, "n_routed_experts", source))
    moe_ffn = int(_need(hf, "moe_intermediate_size", source))
    first_dense = int(hf.get("first_k_dense_replace") or 0)
    pattern = [int(i >= first_dense) for i in range(layers)]
    if not any(pattern):
        raise ValueError(f"{source}: first_k_dense_replace={first_dense} leaves no MoE layer")
    groups = int(hf.get("n_group") or 1)
    shared = int(hf.get("n_shared_experts") or 0)
    return dict(
        mlp_type="moe", num_moe_experts=experts,
        moe_router_topk=int(_need(hf, "num_experts_per_tok", source)),
        moe_ffn_hidden_size=moe_ffn,
        moe_shared_expert_intermediate_size=moe_ffn * shared if shared else None,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=int(hf.get("topk_group") or 1) if groups > 1 else None,
        moe_router_norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        moe_layer_pattern=pattern)


def mla_fields_from_hf(hf: dict, source: str) -> dict:
    if hf.get("attention_bias"):
        # add_bias_linear would also put biases on the MLPs (and experts have none).
        raise ValueError(f"{source}: attention_bias=true is not supported for deepseek_v3 "
                         f"models yet (ms-llm convert handles its tensors)")
    q_lora = hf.get("q_lora_rank")
    return dict(multi_latent_attention=True,
                q_lora_rank=int(q_lora) if q_lora else None,
                kv_lora_rank=int(_need(hf, "kv_lora_rank", source)),
                qk_head_dim=int(_need(hf, "qk_nope_head_dim", source)),
                qk_pos_emb_head_dim=int(_need(hf, "qk_rope_head_dim", source)),
                v_head_dim=int(_need(hf, "v_head_dim", source)),
                mla_rope_interleaved=bool(hf.get("rope_interleave", True)),
                kv_channels=int(hf["qk_nope_head_dim"]) + int(hf["qk_rope_head_dim"]),
                num_query_groups=int(hf["num_attention_heads"]))


def partial_rotary_factor(hf: dict) -> float:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) or 1.0)


def config_from_hf_deepseek(hf: dict, family: str, rope: dict,
                            source: str = "config.json") -> TransformerConfig:
    """``family`` is ``deepseek-v3`` or ``glm45``; ``rope`` the RoPE/YaRN fields already read."""
    heads = int(_need(hf, "num_attention_heads", source))
    common = dict(
        num_layers=int(_need(hf, "num_hidden_layers", source)),
        hidden_size=int(_need(hf, "hidden_size", source)),
        ffn_hidden_size=int(_need(hf, "intermediate_size", source)),
        num_attention_heads=heads,
        padded_vocab_size=int(_need(hf, "vocab_size", source)),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        activation_func="silu" if hf.get("hidden_act", "silu") == "silu" else "gelu",
        moe_router_load_balancing_type="none",
        **rope, **moe_fields_from_hf(hf, source))
    if family == "deepseek-v3":
        return TransformerConfig(**common, **mla_fields_from_hf(hf, source))
    return TransformerConfig(
        **common,
        num_query_groups=int(hf.get("num_key_value_heads") or heads),
        kv_channels=int(hf.get("head_dim") or common["hidden_size"] // heads),
        add_qkv_bias=bool(hf.get("attention_bias", False)),
        qk_layernorm=bool(hf.get("use_qk_norm", False)),
        rotary_percent=partial_rotary_factor(hf))
