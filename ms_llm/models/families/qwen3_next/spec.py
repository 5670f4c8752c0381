"""Qwen3-Next's ``FamilySpec``: names, defaults, per-layer checkpoint layouts, export guess,
test config and qualify row (also the tiny hybrid shapes Qwen3.5 reuses)."""
from __future__ import annotations

from typing import Tuple

from ...config import TransformerConfig
from ...registry import FamilySpec, Qualify
from .hf import from_hf, layer_types_from_hf, layout_extras, to_hf


def layer_kinds(c: TransformerConfig) -> Tuple[str, ...]:
    """Each layer's checkpoint layout: its ``layer_types`` entry, full attention gated."""
    return tuple("gated_attention" if t == "attention" else t
                 for t in (c.layer_types or ["attention"] * c.num_layers))


TINY_HF = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=96, num_experts=4,
               num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=48, linear_key_head_dim=16,
               linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_conv_kernel_dim=4, full_attention_interval=2, mlp_only_layers=[1],
               norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=256,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                "partial_rotary_factor": 0.25})

# ``ms-llm qualify``'s row: the 80B YAML shrunk (Gated DeltaNet / gated attention / Gated
# DeltaNet, chunks of 16 so a 32-token sequence carries a state across chunks, 4 experts top 2
# with a gated shared expert and the aux loss; 16 value heads so in_proj_ba's 32 rows take
# MXFP8's 32-blocks)
TINY_HYBRID_ARGS = ("--model.num_layers", "3",
                    "--model.layer_types", "gated_delta_net,attention,gated_delta_net",
                    "--model.hidden_size", "64", "--model.ffn_hidden_size", "96",
                    "--model.num_attention_heads", "4", "--model.num_query_groups", "2",
                    "--model.kv_channels", "16", "--model.max_position_embeddings", "64",
                    "--model.linear_key_head_dim", "16", "--model.linear_value_head_dim", "16",
                    "--model.linear_num_key_heads", "2", "--model.linear_num_value_heads", "16",
                    "--model.linear_chunk_size", "16")
QUALIFY_ARGS = (*TINY_HYBRID_ARGS, "--model.num_moe_experts", "4",
                "--model.moe_router_topk", "2", "--model.moe_ffn_hidden_size", "32",
                "--model.moe_shared_expert_intermediate_size", "32",
                "--model.moe_aux_loss_coeff", "0.01")

SPEC = FamilySpec(
    name="qwen3-next", hf_model_type="qwen3_next", hf_architecture="Qwen3NextForCausalLM",
    from_hf=from_hf, to_hf=to_hf,
    defaults=dict(qk_layernorm=True, add_qkv_bias=False, layernorm_epsilon=1e-6,
                  attention_output_gate=True, layernorm_zero_centered_gamma=True,
                  rotary_percent=0.25, mlp_type="moe", moe_shared_expert_gate=True),
    aliases=("qwen3_next",), megatron_names=("qwen3-next", "qwen3_next"),
    mindspeed_specs=("qwen3_next",), hybrid_layer_types=layer_types_from_hf,
    claims=lambda c: c.layer_types is not None and "gated_delta_net" in c.layer_types,
    claim_order=5,
    layer_kinds=layer_kinds, layout_extras=layout_extras,
    tiny_hf=TINY_HF,
    qualify=Qualify("qwen3-next", "qwen3_next_80b_a3b.yaml", QUALIFY_ARGS, num_layer_list="1,2"))
