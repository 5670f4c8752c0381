"""What the family modules share: reading the decoder fields every HF ``config.json`` has and
writing them back. A family module adds only what differs."""
from __future__ import annotations

from typing import Mapping, Optional

from ..config import TransformerConfig
from ..yarn import hf_rope_scaling, rope_fields_from_hf


def need(hf: Mapping, key: str, source: str):
    """``hf[key]``, or one line naming the file and the key."""
    if key not in hf or hf[key] is None:
        raise ValueError(f"{source}: missing key {key!r} (needed for {hf.get('model_type')})")
    return hf[key]


def decoder_fields(hf: Mapping, source: str) -> dict:
    """TransformerConfig fields of the decoder every family has: sizes, norm, embeddings, RoPE
    (YaRN included), GQA heads and head dim (``head_dim`` or hidden / heads)."""
    rope = rope_fields_from_hf(hf, source)
    heads = int(need(hf, "num_attention_heads", source))
    hidden = int(need(hf, "hidden_size", source))
    return dict(
        num_layers=int(need(hf, "num_hidden_layers", source)),
        hidden_size=hidden,
        ffn_hidden_size=int(need(hf, "intermediate_size", source)),
        num_attention_heads=heads,
        num_query_groups=int(hf.get("num_key_value_heads") or heads),
        kv_channels=int(hf.get("head_dim") or hidden // heads),
        padded_vocab_size=int(need(hf, "vocab_size", source)),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        add_bias_linear=False,
        activation_func="silu" if hf.get("hidden_act", "silu") == "silu" else "gelu",
        **rope)


def partial_rotary_factor(hf: Mapping) -> float:
    """The rotary fraction of a head (GLM-4.5, Qwen3-Next, Qwen3.5), wherever the config keeps
    it: ``rope_parameters`` / ``rope_scaling`` or the top level."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) or 1.0)


def check_heads(hf: Mapping, source: str) -> None:
    heads = int(need(hf, "num_attention_heads", source))
    groups = int(hf.get("num_key_value_heads") or heads)
    if heads % groups:
        raise ValueError(f"{source}: num_attention_heads {heads} is not a multiple of "
                         f"num_key_value_heads {groups}")


def refuse_attention_bias(hf: Mapping, source: str) -> None:
    """Llama / Qwen3 ``attention_bias`` puts biases on q, k, v and o_proj: no Megatron local-spec
    equivalent (its ``add_qkv_bias`` has no o_proj bias)."""
    if hf.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias=true (biases on o_proj too) has no Megatron "
                         f"local-spec equivalent here")


def decoder_to_hf(c: TransformerConfig, model_type: str, architecture: str) -> dict:
    """The ``config.json`` fields of the decoder (inverse of ``decoder_fields``)."""
    if not c.swiglu or c.add_bias_linear:
        raise ValueError("export: only SwiGLU models without linear biases map to HF "
                         "Llama/Qwen")
    return {
        "model_type": model_type, "architectures": [architecture],
        "hidden_size": c.hidden_size, "intermediate_size": c.ffn_hidden_size,
        "num_attention_heads": c.num_attention_heads, "num_hidden_layers": c.num_layers,
        "num_key_value_heads": c.num_query_groups, "head_dim": c.kv_channels,
        "vocab_size": c.padded_vocab_size, "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.layernorm_epsilon, "rope_theta": c.rotary_base,
        "tie_word_embeddings": not c.untie_embeddings_and_output_weights,
        "hidden_act": "silu", "rope_scaling": hf_rope_scaling(c), "attention_bias": False,
        "torch_dtype": c.params_dtype,
    }


def dense_only(c: TransformerConfig, family: str) -> Optional[str]:
    if c.mlp_type != "dense":
        return f"mlp_type {c.mlp_type!r} (HF {family} is a dense model)"
    return None
