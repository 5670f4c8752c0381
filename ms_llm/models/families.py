"""Model families known by name, and the Hugging Face ``config.json`` -> TransformerConfig map."""
from __future__ import annotations

from typing import Dict

from .config import TransformerConfig
from .yarn import rope_fields_from_hf
from . import families_deepseek as _ds

# Architecture switches per family; sizes come from the YAML config or the HF config.json.
FAMILIES: Dict[str, dict] = {
    "llama": dict(qk_layernorm=False, add_qkv_bias=False, layernorm_epsilon=1e-5),
    "qwen25": dict(qk_layernorm=False, add_qkv_bias=True, layernorm_epsilon=1e-6,
                   rotary_base=1000000.0),
    "qwen3": dict(qk_layernorm=True, add_qkv_bias=False, layernorm_epsilon=1e-6,
                  rotary_base=1000000.0),
    # Qwen3 attention + dropless MoE MLPs (num_moe_experts etc. come from the config).
    "qwen3-moe": dict(qk_layernorm=True, add_qkv_bias=False, layernorm_epsilon=1e-6,
                      rotary_base=1000000.0, mlp_type="moe"),
}
FAMILIES.update(_ds.FAMILIES)      # deepseek-v3, glm45
ALIASES = {"llama2": "llama", "llama3": "llama", "qwen2": "qwen25", "qwen2.5": "qwen25",
           "qwen3_moe": "qwen3-moe", **_ds.ALIASES}
_HF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen25", "qwen3": "qwen3",
                   "qwen3_moe": "qwen3-moe", **_ds.HF_MODEL_TYPES}


def family_defaults(name: str) -> dict:
    key = ALIASES.get(name, name)
    if key not in FAMILIES:
        raise ValueError(f"model.family: unknown family {name!r}; known: {sorted(FAMILIES)}")
    return dict(FAMILIES[key])


def config_from_hf(hf: dict, source: str = "config.json") -> TransformerConfig:
    """Translate a Hugging Face ``config.json`` dict (Llama, Qwen2/2.5, Qwen3, Qwen3-MoE,
    DeepSeek-V3, GLM-4.5)."""
    model_type = hf.get("model_type")
    if model_type not in _HF_MODEL_TYPES:
        raise ValueError(f"{source}: model_type {model_type!r} is not supported; "
                         f"supported: {sorted(_HF_MODEL_TYPES)}")
    rope = rope_fields_from_hf(hf, source)
    family = _HF_MODEL_TYPES[model_type]
    if family in _ds.FAMILIES:
        return _ds.config_from_hf_deepseek(hf, family, rope, source)
    heads = hf["num_attention_heads"]
    bias = bool(hf.get("attention_bias", False))
    if family == "llama" and bias:
        raise ValueError(f"{source}: attention_bias=true (an o_proj bias) is not supported")
    moe = _moe_fields_from_hf(hf, source) if family == "qwen3-moe" else {}
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
        qk_layernorm=family in ("qwen3", "qwen3-moe"),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        add_qkv_bias=family == "qwen25",  # Qwen2/2.5 always have q/k/v biases
        add_bias_linear=False,
        activation_func="silu" if hf.get("hidden_act", "silu") == "silu" else "gelu",
        **rope,
        **moe,
    )


def _moe_fields_from_hf(hf: dict, source: str) -> dict:
    """Qwen3-MoE (``Qwen3MoeSparseMoeBlock``): softmax router, top-k, ``norm_topk_prob``
    renormalises the k weights (= Megatron's top-k-then-softmax, ``moe_router_pre_softmax``
    false); layer i is sparse when ``(i + 1) % decoder_sparse_step == 0`` and i is not in
    ``mlp_only_layers``."""
    try:
        experts, topk = int(hf["num_experts"]), int(hf["num_experts_per_tok"])
        moe_ffn = int(hf["moe_intermediate_size"])
    except KeyError as e:
        raise ValueError(f"{source}: missing key {e.args[0]!r} (needed for qwen3_moe)") from None
    layers = int(hf["num_hidden_layers"])
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    dense = set(hf.get("mlp_only_layers") or [])
    pattern = [int(i not in dense and experts > 0 and (i + 1) % step == 0) for i in range(layers)]
    if not any(pattern):
        raise ValueError(f"{source}: no sparse layer (decoder_sparse_step={step}, "
                         f"mlp_only_layers={sorted(dense)}); load it as a dense model")
    return dict(mlp_type="moe", num_moe_experts=experts, moe_router_topk=topk,
                moe_ffn_hidden_size=moe_ffn,
                moe_router_pre_softmax=not bool(hf.get("norm_topk_prob", False)),
                moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)),
                moe_layer_pattern=pattern)
