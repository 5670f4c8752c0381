"""Hugging Face <-> Megatron-Core (local spec) names and layouts for the dense families.

The QKV fusion is per KV group, ``[g0: q(nh/ng*d) k(d) v(d) | g1: ...]``; a plain
``cat([q, k, v])`` is wrong for GQA. ``linear_fc1`` is ``cat([gate, up])`` (tp = 1).
"""
from __future__ import annotations

from typing import Dict

import numpy as np

from ms_llm.models.config import TransformerConfig
from ms_llm.models.families import config_from_hf  # noqa: F401  (re-exported for callers)

_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.o_proj.bias": "self_attention.linear_proj.bias",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}


def fuse_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray, nh: int, ng: int) -> np.ndarray:
    """HF q/k/v weights ([out, H]) or biases ([out]) -> Megatron's grouped ``linear_qkv``."""
    tail = q.shape[1:]
    r = nh // ng
    d = k.shape[0] // ng
    parts = [q.reshape(ng, r * d, *tail), k.reshape(ng, d, *tail), v.reshape(ng, d, *tail)]
    return np.concatenate(parts, axis=1).reshape(-1, *tail)


def split_qkv(qkv: np.ndarray, nh: int, ng: int):
    tail = qkv.shape[1:]
    r = nh // ng
    d = qkv.shape[0] // (ng * (r + 2))
    g = qkv.reshape(ng, (r + 2) * d, *tail)
    return (g[:, : r * d].reshape(-1, *tail), g[:, r * d:(r + 1) * d].reshape(-1, *tail),
            g[:, (r + 1) * d:].reshape(-1, *tail))


def hf_to_mcore(hf: Dict[str, np.ndarray], config: TransformerConfig,
                source: str = "checkpoint") -> Dict[str, np.ndarray]:
    """HF state dict -> Megatron-Core local-spec state dict (tp = pp = 1)."""
    c = config
    used = set()

    def take(name: str) -> np.ndarray:
        if name not in hf:
            raise KeyError(f"{source}: missing tensor {name!r}")
        used.add(name)
        return hf[name]

    out = {"embedding.word_embeddings.weight": take("model.embed_tokens.weight"),
           "decoder.final_layernorm.weight": take("model.norm.weight")}
    if c.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = take("lm_head.weight")
    elif "lm_head.weight" in hf:
        used.add("lm_head.weight")  # tied checkpoints sometimes store a copy; it is the same tensor
    for i in range(c.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_key, mc_key in _LAYER_RENAMES.items():
            if p + hf_key in hf:
                out[m + mc_key] = take(p + hf_key)
        nh, ng = c.num_attention_heads, c.num_query_groups
        out[m + "self_attention.linear_qkv.weight"] = fuse_qkv(
            take(p + "self_attn.q_proj.weight"), take(p + "self_attn.k_proj.weight"),
            take(p + "self_attn.v_proj.weight"), nh, ng)
        if c.add_qkv_bias or c.add_bias_linear:
            out[m + "self_attention.linear_qkv.bias"] = fuse_qkv(
                take(p + "self_attn.q_proj.bias"), take(p + "self_attn.k_proj.bias"),
                take(p + "self_attn.v_proj.bias"), nh, ng)
        out[m + "mlp.linear_fc1.weight"] = np.concatenate(
            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], axis=0)
    leftover = sorted(set(hf) - used - {k for k in hf if k.endswith("rotary_emb.inv_freq")})
    if leftover:
        raise KeyError(f"{source}: unexpected tensors {leftover[:5]} for this architecture")
    return out
