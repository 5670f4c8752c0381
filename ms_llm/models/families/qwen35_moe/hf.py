"""Qwen3.5-MoE's ``config.json`` <-> TransformerConfig: Qwen3.5's hybrid fields with every layer
MoE (softmax router, top-k always renormalised, a gated shared expert); HF has no dense MLP
size, so Megatron's ``ffn_hidden_size`` is the experts'."""
from __future__ import annotations

from typing import Mapping

from ...config import TransformerConfig
from ..common import need
from ..qwen35.hf import hybrid_fields, hybrid_refusal, refuse_vision_language
from ..qwen3_next.hf import hybrid_to_hf, mtp_extras


def layout_extras(hf: Mapping, source: str) -> dict:
    """The shared expert's HF prefix and the MTP layout facts (as Qwen3-Next's)."""
    return dict(hf_shared="mlp.shared_expert.", **mtp_extras(hf, source))


def from_hf(hf: Mapping, source: str = "config.json") -> TransformerConfig:
    refuse_vision_language(hf, source)
    moe = dict(mlp_type="moe", num_moe_experts=int(need(hf, "num_experts", source)),
               moe_router_topk=int(need(hf, "num_experts_per_tok", source)),
               moe_ffn_hidden_size=int(need(hf, "moe_intermediate_size", source)),
               moe_router_pre_softmax=False,
               moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)))
    shared = int(need(hf, "shared_expert_intermediate_size", source))
    if shared:
        moe.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
    if "intermediate_size" not in hf:        # no dense MLP anywhere: Megatron's ffn size is
        hf = dict(hf, intermediate_size=moe["moe_ffn_hidden_size"])   # the experts'
    return TransformerConfig(**hybrid_fields(hf, source), **moe)


def to_hf(c: TransformerConfig) -> dict:
    why = hybrid_refusal(c)
    if why is None and c.mlp_type != "moe":
        why = f"mlp_type {c.mlp_type!r} (HF Qwen3.5-MoE is MoE; use qwen35)"
    elif why is None and c.ffn_hidden_size != c.moe_ffn_hidden_size:
        why = "ffn_hidden_size unlike moe_ffn_hidden_size (HF has no dense MLP size)"
    elif why is None and not all(c.is_moe_layer(i) for i in range(c.num_layers)):
        why = "dense layers (every Qwen3.5-MoE layer is MoE)"
    elif why is None and (c.moe_router_score_function != "softmax" or c.moe_router_pre_softmax
                          or c.moe_router_enable_expert_bias or not c.moe_shared_expert_gate
                          or not c.moe_shared_expert_intermediate_size):
        why = ("this router / shared expert (HF routes with softmax, renormalises the top k, "
               "gates its shared expert)")
    if why:
        raise ValueError(f"export: HF Qwen3.5-MoE cannot express {why}")
    cfg = hybrid_to_hf(c, "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM")
    cfg.pop("intermediate_size")     # HF Qwen3_5MoeTextConfig has no dense MLP size
    cfg.update(num_experts=c.num_moe_experts, num_experts_per_tok=c.moe_router_topk,
               moe_intermediate_size=c.moe_ffn_hidden_size,
               shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size,
               router_aux_loss_coef=float(c.moe_aux_loss_coeff or 0.0))
    return cfg
