"""Qwen3.5-MoE (the text model of HF ``Qwen3_5MoeForCausalLM``, ``model_type``
"qwen3_5_moe_text"): Qwen3.5's hybrid layers (``ms_llm.models.families.qwen35``: split DeltaNet
projections in the checkpoint, gated attention, zero-centred norms) with Qwen3-Next's MoE in
every layer: softmax router over ``num_experts``, top ``num_experts_per_tok`` always
renormalised (its config has no ``norm_topk_prob`` / ``mlp_only_layers`` /
``decoder_sparse_step``), and a shared expert scaled by ``sigmoid(shared_expert_gate)``.
Transformers 5 fuses the experts in memory and writes them per expert (``mlp.experts.{e}.``),
the names read here."""
from __future__ import annotations

from typing import Mapping

from ..config import TransformerConfig
from ..registry import FamilySpec, Qualify, register_family
from .common import need
from .qwen3_next import mtp_extras
from .qwen35 import (QUALIFY_ARGS as DENSE_QUALIFY, TINY_HF as DENSE_TINY, hybrid_fields, hybrid_refusal, hybrid_to_hf,
                     is_hybrid, layer_kinds, refuse_vision_language)


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


TINY_HF = dict({k: v for k, v in DENSE_TINY.items() if k != "intermediate_size"},
               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=48)

# ``ms-llm qualify``'s row (on tiny_moe.yaml): qwen35's qualify shapes with every layer MoE (4 experts of 32, top 2,
# a gated shared expert of 32, the aux loss on); the dense size equals the experts' (HF
# Qwen3.5-MoE has no dense MLP size, so the export needs them equal)
QUALIFY_ARGS = ("--model.family", "qwen35-moe",
                *DENSE_QUALIFY[2:DENSE_QUALIFY.index("--model.ffn_hidden_size")],
                *DENSE_QUALIFY[DENSE_QUALIFY.index("--model.ffn_hidden_size") + 2:],
                "--model.ffn_hidden_size", "32", "--model.num_moe_experts", "4",
                "--model.moe_router_topk", "2", "--model.moe_ffn_hidden_size", "32",
                "--model.moe_shared_expert_intermediate_size", "32",
                "--model.moe_aux_loss_coeff", "0.01")

SPEC = register_family(FamilySpec(
    name="qwen35-moe", hf_model_type="qwen3_5_moe_text",
    hf_architecture="Qwen3_5MoeForCausalLM", from_hf=from_hf, to_hf=to_hf,
    defaults=dict(qk_layernorm=True, add_qkv_bias=False, layernorm_epsilon=1e-6,
                  attention_output_gate=True, layernorm_zero_centered_gamma=True,
                  rotary_percent=0.25, mlp_type="moe", moe_shared_expert_gate=True),
    aliases=("qwen3_5_moe", "qwen3.5-moe", "qwen3_5_moe_text"),
    megatron_names=("qwen35-moe", "qwen3_5_moe"),
    # An unnamed MoE hybrid is Qwen3.5-MoE only when it looks like what from_hf makes: no
    # moe_layer_pattern (Qwen3-Next's config.json names its dense layers, mlp_only_layers) and
    # no dense MLP size of its own (Qwen3.5-MoE has none; Qwen3-Next's YAML and config.json
    # carry intermediate_size 5120); anything else exports as Qwen3-Next
    claims=lambda c: (is_hybrid(c) and c.mlp_type == "moe" and c.moe_layer_pattern is None
                      and c.ffn_hidden_size == c.moe_ffn_hidden_size),
    claim_order=4, layer_kinds=layer_kinds,
    layout_extras=lambda hf, source: dict(hf_shared="mlp.shared_expert.",
                                          **mtp_extras(hf, source)),
    tiny_hf=TINY_HF, qualify=Qualify("qwen35-moe", "tiny_moe.yaml", QUALIFY_ARGS)))
