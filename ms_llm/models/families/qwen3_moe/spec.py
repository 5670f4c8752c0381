"""Qwen3-MoE's ``FamilySpec``: names, defaults, export guess, test config and qualify row."""
from __future__ import annotations

from ...registry import FamilySpec, Qualify
from ..llama.spec import TINY_ARGS
from .hf import from_hf, to_hf

SPEC = FamilySpec(
    name="qwen3-moe", hf_model_type="qwen3_moe", hf_architecture="Qwen3MoeForCausalLM",
    from_hf=from_hf, to_hf=to_hf,
    # Qwen3 attention + dropless MoE MLPs (num_moe_experts etc. come from the config).
    defaults=dict(qk_layernorm=True, add_qkv_bias=False, layernorm_epsilon=1e-6,
                  rotary_base=1000000.0, mlp_type="moe"),
    aliases=("qwen3_moe",), megatron_names=("qwen3-moe", "qwen3_moe"),
    mindspeed_specs=("qwen3",),
    claims=lambda c: c.mlp_type == "moe", claim_order=30,
    tiny_hf=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=96,
                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True,
                 tie_word_embeddings=False, max_position_embeddings=128),
    qualify=Qualify("qwen3-moe", "tiny_moe.yaml",
                    (*TINY_ARGS, "--model.num_moe_experts", "4", "--model.moe_router_topk", "2",
                     "--model.moe_ffn_hidden_size", "32", "--model.moe_aux_loss_coeff",
                     "0.01"), quick=True))
