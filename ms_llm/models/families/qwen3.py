"""Qwen3 (HF ``Qwen3ForCausalLM``): Llama with per-head RMSNorm on q and k (QK-norm) and an
explicit ``head_dim``."""
from __future__ import annotations

from typing import Mapping

from ..config import TransformerConfig
from ..registry import FamilySpec, Qualify, register_family
from .common import check_heads, decoder_fields, decoder_to_hf, dense_only, refuse_attention_bias
from .llama import TINY_ARGS


def from_hf(hf: Mapping, source: str = "config.json") -> TransformerConfig:
    refuse_attention_bias(hf, source)
    check_heads(hf, source)
    return TransformerConfig(**decoder_fields(hf, source), qk_layernorm=True, add_qkv_bias=False)


def qwen3_attention_refusal(c: TransformerConfig) -> str:
    if not c.qk_layernorm or c.add_qkv_bias:
        return "attention without QK-norm or with QKV bias"
    return ""


def to_hf(c: TransformerConfig) -> dict:
    why = dense_only(c, "Qwen3") or qwen3_attention_refusal(c)
    if why:
        raise ValueError(f"export: HF Qwen3 cannot express {why}")
    return decoder_to_hf(c, "qwen3", "Qwen3ForCausalLM")


SPEC = register_family(FamilySpec(
    name="qwen3", hf_model_type="qwen3", hf_architecture="Qwen3ForCausalLM",
    from_hf=from_hf, to_hf=to_hf,
    defaults=dict(qk_layernorm=True, add_qkv_bias=False, layernorm_epsilon=1e-6,
                  rotary_base=1000000.0),
    megatron_names=("qwen3",),
    claims=lambda c: c.mlp_type == "dense" and c.qk_layernorm, claim_order=40,
    tiny_hf=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=24, vocab_size=96,
                 tie_word_embeddings=False, max_position_embeddings=128),
    qualify=Qualify("qwen3", "tiny.yaml", ("--model.family", "qwen3", *TINY_ARGS))))
