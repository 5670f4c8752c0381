"""Llama 2 / Llama 3 (HF ``LlamaForCausalLM``): RMSNorm, SwiGLU, RoPE, GQA, no biases."""
from __future__ import annotations

from typing import Mapping

from ..config import TransformerConfig
from ..registry import FamilySpec, Qualify, register_family
from .common import check_heads, decoder_fields, decoder_to_hf, dense_only, refuse_attention_bias

TINY_ARGS = ("--model.num_layers", "2", "--model.hidden_size", "64", "--model.ffn_hidden_size",
             "128", "--model.num_attention_heads", "4", "--model.num_query_groups", "2",
             "--model.kv_channels", "16")


def from_hf(hf: Mapping, source: str = "config.json") -> TransformerConfig:
    refuse_attention_bias(hf, source)
    check_heads(hf, source)
    return TransformerConfig(**decoder_fields(hf, source), qk_layernorm=False, add_qkv_bias=False)


def to_hf(c: TransformerConfig) -> dict:
    why = dense_only(c, "Llama") or (
        "QK-norm or QKV bias (HF Llama has neither)" if c.qk_layernorm or c.add_qkv_bias
        else None)
    if why:
        raise ValueError(f"export: HF Llama cannot express {why}")
    return decoder_to_hf(c, "llama", "LlamaForCausalLM")


SPEC = register_family(FamilySpec(
    name="llama", hf_model_type="llama", hf_architecture="LlamaForCausalLM",
    from_hf=from_hf, to_hf=to_hf,
    defaults=dict(qk_layernorm=False, add_qkv_bias=False, layernorm_epsilon=1e-5),
    aliases=("llama2", "llama3"), megatron_names=("llama2", "llama3", "llama"),
    claims=lambda c: c.mlp_type == "dense", claim_order=90,
    tiny_hf=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                 rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=128),
    qualify=Qualify("llama", "tiny.yaml", ("--model.family", "llama", *TINY_ARGS))))
