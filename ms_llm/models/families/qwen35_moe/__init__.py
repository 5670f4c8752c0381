"""Qwen3.5-MoE (the text model of HF ``Qwen3_5MoeForCausalLM``, ``model_type``
"qwen3_5_moe_text"): Qwen3.5's hybrid layers (``ms_llm.models.families.qwen35``: split DeltaNet
projections in the checkpoint, gated attention, zero-centred norms) with Qwen3-Next's MoE in
every layer: softmax router over ``num_experts``, top ``num_experts_per_tok`` always
renormalised (its config has no ``norm_topk_prob`` / ``mlp_only_layers`` /
``decoder_sparse_step``), and a shared expert scaled by ``sigmoid(shared_expert_gate)``.
Transformers 5 fuses the experts in memory and writes them per expert (``mlp.experts.{e}.``),
the names read here."""
from ...registry import register_family
from .spec import SPEC

register_family(SPEC)
