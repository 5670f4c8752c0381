"""Qwen3.5-MoE's ``FamilySpec``: names, defaults, export guess, test config and qualify row
(its per-layer checkpoint layouts are Qwen3.5's)."""
from __future__ import annotations

from ...registry import FamilySpec, Qualify
from ..qwen35.spec import (QUALIFY_ARGS as DENSE_QUALIFY, TINY_HF as DENSE_TINY, is_hybrid,
                           layer_kinds)
from .hf import from_hf, layout_extras, to_hf

TINY_HF = dict({k: v for k, v in DENSE_TINY.items() if k != "intermediate_size"},
               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=48)

# ``ms-llm qualify``'s row (on tiny_moe.yaml): qwen35's qualify shapes with every layer MoE (4
# experts of 32, top 2, a gated shared expert of 32, the aux loss on); the dense size equals the
# experts' (HF Qwen3.5-MoE has no dense MLP size, so the export needs them equal)
QUALIFY_ARGS = ("--model.family", "qwen35-moe",
                *DENSE_QUALIFY[2:DENSE_QUALIFY.index("--model.ffn_hidden_size")],
                *DENSE_QUALIFY[DENSE_QUALIFY.index("--model.ffn_hidden_size") + 2:],
                "--model.ffn_hidden_size", "32", "--model.num_moe_experts", "4",
                "--model.moe_router_topk", "2", "--model.moe_ffn_hidden_size", "32",
                "--model.moe_shared_expert_intermediate_size", "32",
                "--model.moe_aux_loss_coeff", "0.01")

SPEC = FamilySpec(
    name="qwen35-moe", hf_model_type="qwen3_5_moe_text",
    hf_architecture="Qwen3_5MoeForCausalLM", from_hf=from_hf, to_hf=to_hf,
    defaults=dict(qk_layernorm=True, add_qkv_bias=False, layernorm_epsilon=1e-6,
                  attention_output_gate=True, layernorm_zero_centered_gamma=True,
                  rotary_percent=0.25, mlp_type="moe", moe_shared_expert_gate=True),
    aliases=("qwen3_5_moe", "qwen3.5-moe", "qwen3_5_moe_text"),
    megatron_names=("qwen35-moe", "qwen3_5_moe"),
    # An unnamed MoE hybrid is Qwen3.5-MoE only when it looks like what from_hf makes: no
    # moe_layer_pattern (Qwen3-Next's config.json names its dense layers, mlp_only_layers) and
    # no dense MLP size of its own (Qwen3.5-MoE has none; Qwen3-Next's YAML and config.json
    # carry intermediate_size 5120); anything else exports as Qwen3-Next
    claims=lambda c: (is_hybrid(c) and c.mlp_type == "moe" and c.moe_layer_pattern is None
                      and c.ffn_hidden_size == c.moe_ffn_hidden_size),
    claim_order=4, layer_kinds=layer_kinds,
    layout_extras=layout_extras,
    tiny_hf=TINY_HF, qualify=Qualify("qwen35-moe", "tiny_moe.yaml", QUALIFY_ARGS,
                                     num_layer_list="1,2"))
