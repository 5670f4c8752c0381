"""Qwen3's ``FamilySpec``: names, defaults, export guess, test config and qualify row."""
from __future__ import annotations

from ...registry import FamilySpec, Qualify
from ..llama.spec import TINY_ARGS
from .hf import from_hf, to_hf

SPEC = FamilySpec(
    name="qwen3", hf_model_type="qwen3", hf_architecture="Qwen3ForCausalLM",
    from_hf=from_hf, to_hf=to_hf,
    defaults=dict(qk_layernorm=True, add_qkv_bias=False, layernorm_epsilon=1e-6,
                  rotary_base=1000000.0),
    megatron_names=("qwen3",),
    # MindSpeed-LLM's qwen3_spec builds Qwen3 and, with --num-experts, Qwen3-MoE
    mindspeed_specs=("qwen3",),
    claims=lambda c: c.mlp_type == "dense" and c.qk_layernorm, claim_order=40,
    tiny_hf=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=24, vocab_size=96,
                 tie_word_embeddings=False, max_position_embeddings=128),
    qualify=Qualify("qwen3", "tiny.yaml", ("--model.family", "qwen3", *TINY_ARGS), quick=True))
