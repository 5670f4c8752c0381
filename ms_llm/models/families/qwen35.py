"""Qwen3.5 dense (the text model of HF ``Qwen3_5ForCausalLM``, ``model_type`` "qwen3_5_text").

Against Qwen3-Next (``qwen3_next``): the same hybrid layer layout (Gated DeltaNet layers and a
gated full-attention layer every ``full_attention_interval``), the same gated attention (output
gate, partial rotary, QK-norm), zero-centred RMSNorms and gated RMSNorm; the differences are

* the DeltaNet input projections are stored split and flat (``in_proj_qkv`` / ``in_proj_z`` /
  ``in_proj_b`` / ``in_proj_a``), a row permutation of Qwen3-Next's grouped ``in_proj_qkvz`` /
  ``in_proj_ba`` (layer kind ``gated_delta_net_split``, ``ms_llm.checkpoint.layouts_qwen35``);
  the model is Qwen3-Next's module;
* the MLP is dense SwiGLU in every layer (``qwen35-moe`` is the MoE model);
* rotary is multimodal RoPE (``mrope_section``, interleaved); for text every one of its three
  position ids is the token index, so it is plain partial RoPE;
* the published checkpoints are ``Qwen3_5ForConditionalGeneration`` (keys under
  ``model.language_model.``, a ``model.visual.`` tower): reading that folder layout is not
  built; ``Qwen3_5ForCausalLM`` folders (``model.layers.``, and ``mtp.*`` as Qwen3-Next's
  one multi-token prediction layer) are.
"""
from __future__ import annotations

from typing import Mapping, Optional

from ..config import TransformerConfig
from ..registry import FamilySpec, Qualify, register_family
from .common import check_heads, decoder_fields, need, refuse_attention_bias
from .glm45 import partial_rotary_factor
from .qwen3_next import (LINEAR_KEYS, TINY_HF as NEXT_TINY, TINY_HYBRID_ARGS, hybrid_to_hf,
                         layer_types_from_hf, mtp_extras)


def refuse_vision_language(hf: Mapping, source: str) -> None:
    if "text_config" in hf:
        raise ValueError(f"{source}: a Qwen3.5 vision-language config (text_config, keys under "
                         f"model.language_model.) is not built; save the text model as "
                         f"Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM")


def hybrid_fields(hf: Mapping, source: str) -> dict:
    """The TransformerConfig fields Qwen3.5 dense and MoE share (everything but the MLP)."""
    refuse_vision_language(hf, source)
    refuse_attention_bias(hf, source)
    check_heads(hf, source)
    fields = decoder_fields(hf, source)
    fields.update({k: int(need(hf, k, source)) for k in LINEAR_KEYS})
    return dict(fields, qk_layernorm=True, add_qkv_bias=False,
                layer_types=layer_types_from_hf(hf, source), attention_output_gate=True,
                layernorm_zero_centered_gamma=True, rotary_percent=partial_rotary_factor(hf))


def hybrid_refusal(c: TransformerConfig) -> Optional[str]:
    if not (c.attention_output_gate and c.layernorm_zero_centered_gamma and c.qk_layernorm):
        return "a model without gated attention, zero-centred norms and QK-norm"
    if c.layer_types is None:
        return "a model without layer_types"
    return None


def is_hybrid(c: TransformerConfig) -> bool:
    return c.layer_types is not None and "gated_delta_net" in c.layer_types


def layer_kinds(c: TransformerConfig):
    return tuple("gated_attention" if t == "attention" else "gated_delta_net_split"
                 for t in (c.layer_types or ["attention"] * c.num_layers))


def from_hf(hf: Mapping, source: str = "config.json") -> TransformerConfig:
    return TransformerConfig(**hybrid_fields(hf, source))


def to_hf(c: TransformerConfig) -> dict:
    why = hybrid_refusal(c) or (f"mlp_type {c.mlp_type!r} (HF Qwen3.5 is dense; use qwen35-moe)"
                                if c.mlp_type != "dense" else None)
    if why:
        raise ValueError(f"export: HF Qwen3.5 cannot express {why}")
    return hybrid_to_hf(c, "qwen3_5_text", "Qwen3_5ForCausalLM")


TINY_HF = {k: v for k, v in NEXT_TINY.items()
           if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                        "shared_expert_intermediate_size", "mlp_only_layers", "norm_topk_prob")}

# ``ms-llm qualify``'s row: Qwen3-Next's qualify shapes (Gated DeltaNet / gated attention /
# Gated DeltaNet, chunks of 16 so a 32-token sequence carries a state across chunks, 16 value
# heads so in_proj_ba's 32 rows take MXFP8's 32-blocks) with the dense MLP, on tiny.yaml so the
# vocabulary is qualify's 35 words (the 9B YAML's 248320 rows made a step ~10x slower, and
# fsdp-uneven's 35-row split even)
QUALIFY_ARGS = ("--model.family", "qwen35", "--model.untie_embeddings_and_output_weights",
                "true", "--model.rotary_base", "10000000", *TINY_HYBRID_ARGS)

SPEC = register_family(FamilySpec(
    name="qwen35", hf_model_type="qwen3_5_text", hf_architecture="Qwen3_5ForCausalLM",
    from_hf=from_hf, to_hf=to_hf,
    defaults=dict(qk_layernorm=True, add_qkv_bias=False, layernorm_epsilon=1e-6,
                  attention_output_gate=True, layernorm_zero_centered_gamma=True,
                  rotary_percent=0.25),
    aliases=("qwen3_5", "qwen3.5", "qwen3_5_text"), megatron_names=("qwen35", "qwen3_5"),
    # an unnamed dense hybrid model exports as Qwen3.5 (Qwen3-Next is published as MoE only)
    claims=lambda c: is_hybrid(c) and c.mlp_type == "dense", claim_order=4,
    layer_kinds=layer_kinds, layout_extras=mtp_extras, tiny_hf=TINY_HF,
    qualify=Qualify("qwen35", "tiny.yaml", QUALIFY_ARGS)))
