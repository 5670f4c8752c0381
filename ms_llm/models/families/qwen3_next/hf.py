"""Qwen3-Next's ``config.json`` <-> TransformerConfig: ``layer_types`` ("linear_attention" /
"full_attention", or every ``full_attention_interval``-th layer full) as ``layer_types``
("gated_delta_net" / "attention"), the Gated DeltaNet sizes, gated attention, zero-centred norms,
partial rotary, Qwen3-MoE routing with a gated shared expert, and the one MTP layer; also the
helpers Qwen3.5 shares (``hybrid_to_hf``, ``mtp_extras``)."""
from __future__ import annotations

from typing import List, Mapping

from ...config import TransformerConfig
from ..common import (check_heads, decoder_fields, decoder_to_hf, need, partial_rotary_factor,
                      refuse_attention_bias)
from ..qwen3_moe.hf import moe_fields

HF_KINDS = {"linear_attention": "gated_delta_net", "full_attention": "attention"}
LINEAR_KEYS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
               "linear_num_key_heads", "linear_num_value_heads")


def layer_types_from_hf(hf: Mapping, source: str) -> List[str]:
    n = int(need(hf, "num_hidden_layers", source))
    types = hf.get("layer_types")
    if types is None:
        interval = int(hf.get("full_attention_interval", 4) or 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(n)]
    if len(types) != n or any(t not in HF_KINDS for t in types):
        raise ValueError(f"{source}: layer_types {types} must name 'linear_attention' or "
                         f"'full_attention' for each of the {n} layers")
    return [HF_KINDS[t] for t in types]


def mtp_extras(hf: Mapping, source: str) -> dict:
    """The MTP layout facts of a Qwen3-Next / Qwen3.5 ``config.json``: ``mtp_num_hidden_layers``
    (also read as ``num_nextn_predict_layers``) depths kept under ``mtp.`` with one set of
    ``fc`` / norms, whose layer is full attention."""
    n = int(hf.get("mtp_num_hidden_layers", hf.get("num_nextn_predict_layers", 0)) or 0)
    if n > 1:
        raise ValueError(f"{source}: mtp_num_hidden_layers {n}: more than one MTP layer is not "
                         f"built for this family (its mtp.fc / norms are one set)")
    return dict(mtp_layers=n, mtp_hf="mtp", mtp_kind="gated_attention")


def mtp_to_hf(c: TransformerConfig) -> dict:
    if (c.mtp_num_layers or 0) > 1:
        raise ValueError(f"export: HF Qwen3-Next / Qwen3.5 hold one MTP layer, not "
                         f"{c.mtp_num_layers}")
    return {"mtp_num_hidden_layers": c.mtp_num_layers or 0, "mtp_use_dedicated_embeddings": False}


def layout_extras(hf: Mapping, source: str) -> dict:
    """The shared expert's HF prefix and the MTP layout facts."""
    return dict(hf_shared="mlp.shared_expert.", **mtp_extras(hf, source))


def from_hf(hf: Mapping, source: str = "config.json") -> TransformerConfig:
    refuse_attention_bias(hf, source)
    check_heads(hf, source)
    fields = decoder_fields(hf, source)
    extra = {k: int(need(hf, k, source)) for k in LINEAR_KEYS}
    moe = {}
    if int(hf.get("num_experts", 0) or 0) > 0:
        moe = moe_fields(hf, source)
        shared = int(hf.get("shared_expert_intermediate_size", 0) or 0)
        if shared:
            moe.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
    return TransformerConfig(**fields, **extra, **moe, qk_layernorm=True,
                             layer_types=layer_types_from_hf(hf, source),
                             attention_output_gate=True, layernorm_zero_centered_gamma=True,
                             rotary_percent=partial_rotary_factor(hf))


def hybrid_to_hf(c: TransformerConfig, model_type: str, architecture: str) -> dict:
    """The HF config fields every hybrid family writes alike (Qwen3-Next, Qwen3.5): partial
    rotary as ``rope_parameters``, the linear-attention sizes, ``layer_types`` and MTP."""
    cfg = decoder_to_hf(c, model_type, architecture)
    cfg.pop("rope_theta")
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": c.rotary_base,
                              "partial_rotary_factor": c.rotary_percent}
    inverse = {v: k for k, v in HF_KINDS.items()}
    cfg.update({k: getattr(c, k) for k in LINEAR_KEYS})
    cfg["layer_types"] = [inverse[t] for t in c.layer_types]
    cfg.update(mtp_to_hf(c))
    return cfg


def to_hf(c: TransformerConfig) -> dict:
    why = None
    if not (c.attention_output_gate and c.layernorm_zero_centered_gamma and c.qk_layernorm):
        why = "a model without gated attention, zero-centred norms and QK-norm"
    elif c.layer_types is None:
        why = "a model without layer_types"
    elif c.mlp_type == "moe" and (c.moe_router_score_function != "softmax"
                                  or c.moe_router_enable_expert_bias
                                  or not c.moe_shared_expert_gate):
        why = "this router / shared expert (HF routes with softmax, gates its shared expert)"
    if why:
        raise ValueError(f"export: HF Qwen3-Next cannot express {why}")
    cfg = hybrid_to_hf(c, "qwen3_next", "Qwen3NextForCausalLM")
    if c.mlp_type == "moe":
        cfg.update(num_experts=c.num_moe_experts, num_experts_per_tok=c.moe_router_topk,
                   moe_intermediate_size=c.moe_ffn_hidden_size,
                   norm_topk_prob=not c.moe_router_pre_softmax, decoder_sparse_step=1,
                   mlp_only_layers=[i for i in range(c.num_layers) if not c.is_moe_layer(i)],
                   shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size or 0,
                   router_aux_loss_coef=float(c.moe_aux_loss_coeff or 0.0))
    else:
        cfg.update(num_experts=0, mlp_only_layers=list(range(c.num_layers)))
    return cfg
