"""Qwen2 / Qwen2.5 (HF ``Qwen2ForCausalLM``): Llama with q/k/v biases (no o_proj bias) and no
``head_dim`` key (head dim = hidden / heads)."""
from __future__ import annotations

from typing import Mapping

from ..config import TransformerConfig
from ..registry import FamilySpec, Qualify, register_family
from .common import check_heads, decoder_fields, decoder_to_hf, dense_only
from .llama import TINY_ARGS


def from_hf(hf: Mapping, source: str = "config.json") -> TransformerConfig:
    check_heads(hf, source)
    # Qwen2/2.5 always have q/k/v biases (attention_bias is not read by its modeling code).
    return TransformerConfig(**decoder_fields(hf, source), qk_layernorm=False, add_qkv_bias=True)


def to_hf(c: TransformerConfig) -> dict:
    why = dense_only(c, "Qwen2") or (
        "QK-norm or attention without QKV bias (HF Qwen2 always has q/k/v biases)"
        if c.qk_layernorm or not c.add_qkv_bias else None)
    if why:
        raise ValueError(f"export: HF Qwen2 cannot express {why}")
    if c.kv_channels * c.num_attention_heads != c.hidden_size:
        raise ValueError(f"export: Qwen2 config.json has no head_dim; kv_channels "
                         f"{c.kv_channels} must equal hidden_size / heads")
    cfg = decoder_to_hf(c, "qwen2", "Qwen2ForCausalLM")
    del cfg["head_dim"], cfg["attention_bias"]
    return cfg


SPEC = register_family(FamilySpec(
    name="qwen25", hf_model_type="qwen2", hf_architecture="Qwen2ForCausalLM",
    from_hf=from_hf, to_hf=to_hf,
    defaults=dict(qk_layernorm=False, add_qkv_bias=True, layernorm_epsilon=1e-6,
                  rotary_base=1000000.0),
    aliases=("qwen2", "qwen2.5"), megatron_names=("qwen25", "qwen2.5", "qwen2"),
    claims=lambda c: c.mlp_type == "dense" and c.add_qkv_bias and not c.qk_layernorm,
    claim_order=50,
    tiny_hf=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                 rope_theta=1000000.0, tie_word_embeddings=False, max_position_embeddings=128),
    qualify=Qualify("qwen2.5", "tiny.yaml", ("--model.family", "qwen25", *TINY_ARGS))))
