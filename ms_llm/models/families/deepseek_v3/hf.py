"""DeepSeek-V3's ``config.json`` <-> TransformerConfig: MLA fields (Megatron-Core's
MLATransformerConfig names: ``qk_head_dim`` = HF ``qk_nope_head_dim``, ``qk_pos_emb_head_dim`` =
``qk_rope_head_dim``) and the DeepSeek router (``deepseek_moe``)."""
from __future__ import annotations

from typing import Mapping

from ...config import TransformerConfig
from .. import deepseek_moe as DS
from ..common import need


def mla_fields(hf: Mapping, source: str) -> dict:
    q_lora = hf.get("q_lora_rank")
    return dict(multi_latent_attention=True,
                q_lora_rank=int(q_lora) if q_lora else None,
                kv_lora_rank=int(need(hf, "kv_lora_rank", source)),
                qk_head_dim=int(need(hf, "qk_nope_head_dim", source)),
                qk_pos_emb_head_dim=int(need(hf, "qk_rope_head_dim", source)),
                v_head_dim=int(need(hf, "v_head_dim", source)),
                mla_rope_interleaved=bool(hf.get("rope_interleave", True)),
                kv_channels=int(hf["qk_nope_head_dim"]) + int(hf["qk_rope_head_dim"]),
                num_query_groups=int(hf["num_attention_heads"]))


def config_for_layout(hf: Mapping, source: str) -> TransformerConfig:
    """``from_hf`` without its ``attention_bias`` refusal: the converter carries MLA's linear
    biases though the model has no place for them."""
    return TransformerConfig(**DS.common_fields(hf, source), **mla_fields(hf, source))


def from_hf(hf: Mapping, source: str = "config.json") -> TransformerConfig:
    if hf.get("attention_bias"):
        # add_bias_linear would also put biases on the MLPs (and experts have none).
        raise ValueError(f"{source}: attention_bias=true is not supported for deepseek_v3 "
                         f"models yet (ms-llm convert handles its tensors)")
    return config_for_layout(hf, source)


def layout_extras(hf: Mapping, source: str) -> dict:
    """MTP depths and the MLA linear biases (``attention_bias``), which the converter carries
    though the model has no place for them."""
    return dict(DS.layout_extras(hf, source), attn_bias=bool(hf.get("attention_bias", False)))


def to_hf(c: TransformerConfig) -> dict:
    cfg = DS.common_to_hf(c, "DeepSeek-V3")
    cfg.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
               num_key_value_heads=c.num_attention_heads, q_lora_rank=c.q_lora_rank,
               kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_head_dim,
               qk_rope_head_dim=c.qk_pos_emb_head_dim, v_head_dim=c.v_head_dim,
               rope_interleave=bool(c.mla_rope_interleaved),
               attention_bias=bool(c.add_bias_linear))
    return cfg
