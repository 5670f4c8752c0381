"""Grouped-query attention with a fused ``linear_qkv`` (layer kind ``"attention"``).

GQA rules (Megatron-Core's local spec): ``linear_qkv`` per KV group ``[q(nh/ng*d) k(d) v(d)]``,
tp rank r holds groups ``[r*ng/tp, (r+1)*ng/tp)`` (a contiguous dim-0 chunk); ``linear_proj``
dim-1 chunks; QK-norm weights replicated.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Dict, List, Tuple

import numpy as np

from .kinds import A, EXTRA, LayerKind, fuse_qkv, split_qkv


def _gqa_hf_names(spec, p: str) -> List[Tuple[str, tuple]]:
    H, d = spec.hidden, spec.head_dim
    out = [(p + "self_attn.q_proj.weight", (spec.heads * d, H))]
    if spec.qkv_bias:
        out.append((p + "self_attn.q_proj.bias", (spec.heads * d,)))
    out.append((p + "self_attn.k_proj.weight", (spec.groups * d, H)))
    if spec.qkv_bias:
        out.append((p + "self_attn.k_proj.bias", (spec.groups * d,)))
    out.append((p + "self_attn.v_proj.weight", (spec.groups * d, H)))
    if spec.qkv_bias:
        out.append((p + "self_attn.v_proj.bias", (spec.groups * d,)))
    out.append((p + "self_attn.o_proj.weight", (H, spec.heads * d)))
    if spec.qk_norm:
        out += [(p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,))]
    return out


def _gqa_hf_to_full(spec, get: Callable[[str], np.ndarray], p: str) -> Dict:
    a, ng = p + "self_attn.", spec.groups
    full = OrderedDict()
    full[A + "linear_proj.weight"] = get(a + "o_proj.weight")
    full[A + "linear_qkv.weight"] = fuse_qkv(
        get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight"), ng)
    if spec.qkv_bias:
        full[A + "linear_qkv.bias"] = fuse_qkv(
            get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias"), ng)
    if spec.qk_norm:
        full[A + "q_layernorm.weight"] = get(a + "q_norm.weight")
        full[A + "k_layernorm.weight"] = get(a + "k_norm.weight")
    return full


def _gqa_full_to_hf(spec, full: Dict, p: str) -> Dict:
    a = p + "self_attn."
    hf = {a + "o_proj.weight": full[A + "linear_proj.weight"]}
    q, k, v = split_qkv(full[A + "linear_qkv.weight"], spec.heads, spec.groups, spec.head_dim)
    hf.update({a + "q_proj.weight": q, a + "k_proj.weight": k, a + "v_proj.weight": v})
    if spec.qkv_bias:
        q, k, v = split_qkv(full[A + "linear_qkv.bias"], spec.heads, spec.groups,
                            spec.head_dim)
        hf.update({a + "q_proj.bias": q, a + "k_proj.bias": k, a + "v_proj.bias": v})
    if spec.qk_norm:
        hf[a + "q_norm.weight"] = full[A + "q_layernorm.weight"]
        hf[a + "k_norm.weight"] = full[A + "k_layernorm.weight"]
    return hf


def _gqa_shard(spec, full: Dict, tp: int, t: int) -> "OrderedDict":
    out = OrderedDict()
    out[A + "linear_proj.weight"] = np.split(full[A + "linear_proj.weight"], tp, axis=1)[t]
    out[A + "linear_proj." + EXTRA] = None
    out[A + "linear_qkv.weight"] = np.split(full[A + "linear_qkv.weight"], tp, axis=0)[t]
    if spec.qkv_bias:
        out[A + "linear_qkv.bias"] = np.split(full[A + "linear_qkv.bias"], tp, axis=0)[t]
    out[A + "linear_qkv." + EXTRA] = None
    if spec.qk_norm:
        out[A + "q_layernorm.weight"] = full[A + "q_layernorm.weight"]
        out[A + "k_layernorm.weight"] = full[A + "k_layernorm.weight"]
    return out


def _gqa_merge(spec, part, tp: int) -> "OrderedDict":
    full = OrderedDict()
    full[A + "linear_proj.weight"] = np.concatenate(
        [part(t, 0, A + "linear_proj.weight") for t in range(tp)], axis=1)
    full[A + "linear_qkv.weight"] = np.concatenate(
        [part(t, 0, A + "linear_qkv.weight") for t in range(tp)], axis=0)
    if spec.qkv_bias:
        full[A + "linear_qkv.bias"] = np.concatenate(
            [part(t, 0, A + "linear_qkv.bias") for t in range(tp)], axis=0)
    if spec.qk_norm:
        full[A + "q_layernorm.weight"] = part(0, 0, A + "q_layernorm.weight")
        full[A + "k_layernorm.weight"] = part(0, 0, A + "k_layernorm.weight")
    return full


GQA = LayerKind(_gqa_hf_names, _gqa_hf_to_full, _gqa_full_to_hf, _gqa_shard, _gqa_merge)
