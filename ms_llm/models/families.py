"""Model families known by name, and the Hugging Face ``config.json`` -> TransformerConfig map."""
from __future__ import annotations

from typing import Dict

from .config import TransformerConfig

# Architecture switches per family; sizes come from the YAML config or the HF config.json.
FAMILIES: Dict[str, dict] = {
    "llama": dict(qk_layernorm=False, add_qkv_bias=False, layernorm_epsilon=1e-5),
    "qwen25": dict(qk_layernorm=False, add_qkv_bias=True, layernorm_epsilon=1e-6,
                   rotary_base=1000000.0),
    "qwen3": dict(qk_layernorm=True, add_qkv_bias=False, layernorm_epsilon=1e-6,
                  rotary_base=1000000.0),
}
ALIASES = {"llama2": "llama", "llama3": "llama", "qwen2": "qwen25", "qwen2.5": "qwen25"}
_HF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen25", "qwen3": "qwen3"}


def family_defaults(name: str) -> dict:
    key = ALIASES.get(name, name)
    if key not in FAMILIES:
        raise ValueError(f"model.family: unknown family {name!r}; known: {sorted(FAMILIES)}")
    return dict(FAMILIES[key])


def config_from_hf(hf: dict, source: str = "config.json") -> TransformerConfig:
    """Translate a Hugging Face ``config.json`` dict (Llama, Qwen2/2.5, Qwen3)."""
    model_type = hf.get("model_type")
    if model_type not in _HF_MODEL_TYPES:
        raise ValueError(f"{source}: model_type {model_type!r} is not supported; "
                         f"supported: {sorted(_HF_MODEL_TYPES)}")
    scaling = hf.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ValueError(f"{source}: rope_scaling {scaling!r} is not supported yet")
    family = _HF_MODEL_TYPES[model_type]
    heads = hf["num_attention_heads"]
    bias = bool(hf.get("attention_bias", False))
    if family == "llama" and bias:
        raise ValueError(f"{source}: attention_bias=true (an o_proj bias) is not supported")
    return TransformerConfig(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads", heads),
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        padded_vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        qk_layernorm=family == "qwen3",
        rotary_base=float(hf.get("rope_theta", 10000.0)),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        add_qkv_bias=family == "qwen25",  # Qwen2/2.5 always have q/k/v biases
        add_bias_linear=False,
        activation_func="silu" if hf.get("hidden_act", "silu") == "silu" else "gelu",
    )
