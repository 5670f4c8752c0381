"""Llama's ``FamilySpec``: names, defaults, export guess, test config and qualify row."""
from __future__ import annotations

from ...registry import FamilySpec, Qualify
from .hf import from_hf, to_hf

# The tiny dense shapes ``ms-llm qualify`` trains (the dense Qwen families reuse them)
TINY_ARGS = ("--model.num_layers", "2", "--model.hidden_size", "64", "--model.ffn_hidden_size",
             "128", "--model.num_attention_heads", "4", "--model.num_query_groups", "2",
             "--model.kv_channels", "16")

SPEC = FamilySpec(
    name="llama", hf_model_type="llama", hf_architecture="LlamaForCausalLM",
    from_hf=from_hf, to_hf=to_hf,
    defaults=dict(qk_layernorm=False, add_qkv_bias=False, layernorm_epsilon=1e-5),
    aliases=("llama2", "llama3"), megatron_names=("llama2", "llama3", "llama"),
    mindspeed_specs=("llama",),
    claims=lambda c: c.mlp_type == "dense", claim_order=90,
    tiny_hf=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                 rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=128),
    qualify=Qualify("llama", "tiny.yaml", ("--model.family", "llama", *TINY_ARGS)))
