"""HF ``config.json`` of a DeepSeek-V3 (``deepseek_v3``) or GLM-4.5 (``glm4_moe``) model from a
TransformerConfig, for ``ms-llm export``: the inverse of
``ms_llm.models.families_deepseek.config_from_hf_deepseek``.

Which family: multi-head latent attention is DeepSeek-V3; a sigmoid router with expert bias on
grouped-query attention is GLM-4.5. What neither HF class can express (dense layers anywhere but
first, routers without expert bias, ...) is refused with the reason."""
from __future__ import annotations

from typing import Optional, Tuple


def is_deepseek_family(c) -> bool:
    """MLA, or GLM-4.5's MoE (sigmoid router with expert bias and shared experts; without
    shared experts the model is left to the Qwen3-MoE export, which says what it lacks)."""
    return bool(c.multi_latent_attention) or (
        c.mlp_type == "moe" and c.moe_router_score_function == "sigmoid"
        and c.moe_router_enable_expert_bias and bool(c.moe_shared_expert_intermediate_size))


def _refusal(c) -> Optional[str]:
    if c.mlp_type != "moe":
        return "a dense MLP everywhere (both HF classes are MoE models)"
    if c.moe_router_score_function != "sigmoid" or not c.moe_router_enable_expert_bias:
        return "a router without sigmoid scores and expert bias"
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


def hf_config_deepseek(c, model_type_hf: Optional[str] = None) -> Tuple[dict, str]:
    """``(config.json dict, model_type_hf)``; raises ``ValueError`` naming what HF lacks."""
    from ms_llm.models.yarn import hf_rope_scaling
    mt = "deepseek3" if c.multi_latent_attention else "glm45"
    if model_type_hf is not None and model_type_hf != mt:
        from .layouts import MODEL_TYPES
        if MODEL_TYPES.get(model_type_hf, (None,))[0] != MODEL_TYPES[mt][0]:
            raise ValueError(f"export: model_type_hf {model_type_hf!r} cannot hold this model "
                             f"(it exports as {mt})")
        mt = model_type_hf
    why = _refusal(c)
    if why:
        raise ValueError(f"export: HF {'DeepSeek-V3' if mt == 'deepseek3' else 'GLM-4.5'} "
                         f"cannot express {why}")
    pattern = [int(c.is_moe_layer(i)) for i in range(c.num_layers)]
    groups = c.moe_router_num_groups or 1
    rope = {"rope_theta": c.rotary_base, "rope_type": "default"}
    scaling = hf_rope_scaling(c)
    if scaling:
        rope.update(scaling)
    cfg = {
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
        "num_nextn_predict_layers": c.mtp_num_layers or 0, "rope_parameters": rope, "rope_theta": c.rotary_base,
        "torch_dtype": c.params_dtype,
    }
    if mt == "deepseek3":
        cfg.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
                   num_key_value_heads=c.num_attention_heads, q_lora_rank=c.q_lora_rank,
                   kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_head_dim,
                   qk_rope_head_dim=c.qk_pos_emb_head_dim, v_head_dim=c.v_head_dim,
                   rope_interleave=bool(c.mla_rope_interleaved),
                   attention_bias=bool(c.add_bias_linear))
    else:
        if c.add_bias_linear:
            raise ValueError("export: HF GLM-4.5 has no o_proj / MLP biases (add_bias_linear)")
        rope["partial_rotary_factor"] = c.rotary_percent
        cfg.update(model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"],
                   num_key_value_heads=c.num_query_groups, head_dim=c.kv_channels,
                   attention_bias=bool(c.add_qkv_bias), use_qk_norm=bool(c.qk_layernorm),
                   partial_rotary_factor=c.rotary_percent)
    return cfg, mt
