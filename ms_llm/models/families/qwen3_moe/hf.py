"""Qwen3-MoE's ``config.json`` <-> TransformerConfig.

Which layers are sparse is computed here once (``sparse_pattern``): layer i is sparse when
``(i + 1) % decoder_sparse_step == 0`` and i is not in ``mlp_only_layers``. Writing HF spells the
pattern per layer (``decoder_sparse_step`` 1 + ``mlp_only_layers``), because Megatron's int
``moe_layer_freq`` N (layers 0, N, 2N.. sparse) is not HF's ``decoder_sparse_step`` N (N-1,
2N-1..)."""
from __future__ import annotations

from typing import List, Mapping, Optional

from ...config import TransformerConfig
from ..common import check_heads, decoder_fields, decoder_to_hf, refuse_attention_bias
from ..qwen3.hf import qwen3_attention_refusal


def sparse_pattern(hf: Mapping, layers: int, experts: int) -> List[int]:
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    dense = set(hf.get("mlp_only_layers") or [])
    return [int(i not in dense and experts > 0 and (i + 1) % step == 0) for i in range(layers)]


def moe_fields(hf: Mapping, source: str) -> dict:
    # transformers 5 writes ``num_local_experts`` (its attribute map for ``num_experts``,
    # the name published Qwen3-MoE configs use)
    if "num_experts" not in hf and "num_local_experts" in hf:
        hf = dict(hf, num_experts=hf["num_local_experts"])
    try:
        experts, topk = int(hf["num_experts"]), int(hf["num_experts_per_tok"])
        moe_ffn = int(hf["moe_intermediate_size"])
    except KeyError as e:
        raise ValueError(f"{source}: missing key {e.args[0]!r} (needed for qwen3_moe)") from None
    pattern = sparse_pattern(hf, int(hf["num_hidden_layers"]), experts)
    if not any(pattern):
        raise ValueError(f"{source}: no sparse layer (decoder_sparse_step="
                         f"{int(hf.get('decoder_sparse_step', 1) or 1)}, mlp_only_layers="
                         f"{sorted(set(hf.get('mlp_only_layers') or []))}); load it as a dense "
                         f"model")
    return dict(mlp_type="moe", num_moe_experts=experts, moe_router_topk=topk,
                moe_ffn_hidden_size=moe_ffn,
                moe_router_pre_softmax=not bool(hf.get("norm_topk_prob", False)),
                moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)),
                moe_layer_pattern=pattern)


def from_hf(hf: Mapping, source: str = "config.json") -> TransformerConfig:
    refuse_attention_bias(hf, source)
    check_heads(hf, source)
    fields = decoder_fields(hf, source)
    return TransformerConfig(**fields, qk_layernorm=True, add_qkv_bias=False,
                             **moe_fields(hf, source))


def refusal(c: TransformerConfig) -> Optional[str]:
    """Why HF Qwen3-MoE cannot express this MoE config, or None. Training-only settings (aux /
    z-loss coefficients, load-balancing type) do not change the forward and are not checked."""
    if c.mlp_type != "moe":
        return "a dense model (mlp_type 'dense')"
    if c.moe_router_score_function != "softmax":
        return (f"moe_router_score_function {c.moe_router_score_function!r} (HF Qwen3-MoE "
                f"routes with softmax)")
    if c.moe_router_enable_expert_bias:
        return "moe_router_enable_expert_bias (HF Qwen3-MoE has no router bias)"
    if c.moe_shared_expert_intermediate_size:
        return "shared experts (moe_shared_expert_intermediate_size; HF Qwen3-MoE has none)"
    if c.moe_router_topk_scaling_factor not in (None, 1, 1.0):
        return (f"moe_router_topk_scaling_factor {c.moe_router_topk_scaling_factor} (HF "
                f"Qwen3-MoE does not scale the routing weights)")
    if qwen3_attention_refusal(c):
        return qwen3_attention_refusal(c) + " (Qwen3-MoE attention is Qwen3's)"
    if not any(c.is_moe_layer(i) for i in range(c.num_layers)):
        return "no MoE layer (moe_layer_freq / moe_layer_pattern); export it as a dense model"
    return None


def to_hf(c: TransformerConfig) -> dict:
    why = refusal(c)
    if why:
        raise ValueError(f"export: HF Qwen3-MoE cannot express {why}")
    cfg = decoder_to_hf(c, "qwen3_moe", "Qwen3MoeForCausalLM")
    cfg.update(num_experts=c.num_moe_experts, num_experts_per_tok=c.moe_router_topk,
               moe_intermediate_size=c.moe_ffn_hidden_size,
               norm_topk_prob=not c.moe_router_pre_softmax, decoder_sparse_step=1,
               mlp_only_layers=[i for i in range(c.num_layers) if not c.is_moe_layer(i)],
               router_aux_loss_coef=float(c.moe_aux_loss_coeff or 0.0))
    return cfg
