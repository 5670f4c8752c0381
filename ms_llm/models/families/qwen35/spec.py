"""Qwen3.5's ``FamilySpec``: names, defaults, per-layer checkpoint layouts (shared with
Qwen3.5-MoE), export guess, test config and qualify row."""
from __future__ import annotations

from ...config import TransformerConfig
from ...registry import FamilySpec, Qualify
from ..qwen3_next.hf import mtp_extras
from ..qwen3_next.spec import TINY_HF as NEXT_TINY, TINY_HYBRID_ARGS
from .hf import from_hf, to_hf


def is_hybrid(c: TransformerConfig) -> bool:
    return c.layer_types is not None and "gated_delta_net" in c.layer_types


def layer_kinds(c: TransformerConfig):
    return tuple("gated_attention" if t == "attention" else "gated_delta_net_split"
                 for t in (c.layer_types or ["attention"] * c.num_layers))


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

SPEC = FamilySpec(
    name="qwen35", hf_model_type="qwen3_5_text", hf_architecture="Qwen3_5ForCausalLM",
    from_hf=from_hf, to_hf=to_hf,
    defaults=dict(qk_layernorm=True, add_qkv_bias=False, layernorm_epsilon=1e-6,
                  attention_output_gate=True, layernorm_zero_centered_gamma=True,
                  rotary_percent=0.25),
    aliases=("qwen3_5", "qwen3.5", "qwen3_5_text"), megatron_names=("qwen35", "qwen3_5"),
    # an unnamed dense hybrid model exports as Qwen3.5 (Qwen3-Next is published as MoE only)
    claims=lambda c: is_hybrid(c) and c.mlp_type == "dense", claim_order=4,
    layer_kinds=layer_kinds, layout_extras=mtp_extras, tiny_hf=TINY_HF,
    qualify=Qualify("qwen35", "tiny.yaml", QUALIFY_ARGS, num_layer_list="1,2"))
