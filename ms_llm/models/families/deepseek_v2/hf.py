"""DeepSeek-V2's ``config.json`` <-> TransformerConfig: DeepSeek-V3's MLA fields and MoE shapes
(``deepseek_moe``), with V2's router: softmax over every expert, then top-k (``topk_method``
greedy), the k weights renormalised only with ``norm_topk_prob`` (DeepSeek's released modeling
code; transformers' class never renormalises and the released V2 / V2-Lite configs say false),
times ``routed_scaling_factor``. Megatron-Core's router says the same with
``moe_router_pre_softmax`` (true: no renormalisation; false: top-k of the logits, softmaxed over
those k, which is the renormalised softmax) and ``moe_router_topk_scaling_factor``."""
from __future__ import annotations

from typing import Mapping

from ...config import TransformerConfig
from .. import deepseek_moe as DS
from ..deepseek_v3.hf import mla_fields


def v2_fields(hf: Mapping, source: str) -> dict:
    """The decoder and MoE fields DeepSeek-V3 reads, with V2's softmax router and ``moe_layer_freq`` (DeepSeek's modeling code: layer i is MoE when
    ``i >= first_k_dense_replace`` and ``i % moe_layer_freq == 0``)."""
    method = hf.get("topk_method") or "greedy"
    if method != "greedy":
        raise ValueError(f"{source}: topk_method {method!r}: DeepSeek-V2's group-limited routing "
                         f"(the best expert of each group ranks it) is not built; greedy is")
    fields = DS.common_fields(hf, source)
    freq = int(hf.get("moe_layer_freq") or 1)
    fields["moe_layer_pattern"] = [int(v and i % freq == 0)
                                   for i, v in enumerate(fields["moe_layer_pattern"])]
    scale = float(hf.get("routed_scaling_factor") or 1.0)
    fields.update(moe_router_score_function="softmax", moe_router_enable_expert_bias=False,
                  moe_router_num_groups=None, moe_router_group_topk=None,
                  moe_router_norm_topk_prob=True,   # the sigmoid router's key: unused here
                  moe_router_pre_softmax=not bool(hf.get("norm_topk_prob", False)),
                  moe_router_topk_scaling_factor=scale)
    return fields


def from_hf(hf: Mapping, source: str = "config.json") -> TransformerConfig:
    if hf.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias=true is not supported for deepseek_v2 "
                         f"models (MLA's linears have no bias here)")
    return TransformerConfig(**v2_fields(hf, source), **mla_fields(hf, source))


def router_refusal(c: TransformerConfig) -> str:
    """"" when HF's DeepSeek-V2 router expresses ``c``'s, else what it cannot."""
    if c.moe_router_score_function != "softmax" or c.moe_router_enable_expert_bias:
        return "a router without softmax scores, or with expert bias (DeepSeek-V3's)"
    if c.moe_router_num_groups and c.moe_router_num_groups > 1:
        return "group-limited routing"
    return ""


def to_hf(c: TransformerConfig) -> dict:
    cfg = DS.common_to_hf(c, "DeepSeek-V2", router_refusal(c))
    for key in ("n_group", "topk_group", "num_nextn_predict_layers"):
        cfg.pop(key)
    if c.mtp_num_layers:
        raise ValueError("export: HF DeepSeek-V2 has no multi-token prediction layers")
    cfg.update(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"],
               num_key_value_heads=c.num_attention_heads, q_lora_rank=c.q_lora_rank,
               kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_head_dim,
               qk_rope_head_dim=c.qk_pos_emb_head_dim, v_head_dim=c.v_head_dim,
               topk_method="greedy", norm_topk_prob=not c.moe_router_pre_softmax,
               attention_bias=False)
    return cfg
