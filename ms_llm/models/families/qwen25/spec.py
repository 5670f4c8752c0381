"""Qwen2.5's ``FamilySpec``: names, defaults, export guess, test config and qualify row."""
from __future__ import annotations

from ...registry import FamilySpec, Qualify
from ..llama.spec import TINY_ARGS
from .hf import from_hf, to_hf

SPEC = FamilySpec(
    name="qwen25", hf_model_type="qwen2", hf_architecture="Qwen2ForCausalLM",
    from_hf=from_hf, to_hf=to_hf,
    defaults=dict(qk_layernorm=False, add_qkv_bias=True, layernorm_epsilon=1e-6,
                  rotary_base=1000000.0),
    aliases=("qwen2", "qwen2.5"), megatron_names=("qwen25", "qwen2.5", "qwen2"),
    mindspeed_specs=("qwen25",),
    claims=lambda c: c.mlp_type == "dense" and c.add_qkv_bias and not c.qk_layernorm,
    claim_order=50,
    tiny_hf=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                 rope_theta=1000000.0, tie_word_embeddings=False, max_position_embeddings=128),
    qualify=Qualify("qwen2.5", "tiny.yaml", ("--model.family", "qwen25", *TINY_ARGS)))
