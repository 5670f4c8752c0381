"""The token-mixing part of a decoder layer in each checkpoint layout (``LayerKind``), by name.

A family names each layer's kind (``FamilySpec.layer_kinds``: ``"attention"`` for grouped-query
attention with a fused ``linear_qkv``, ``"mla"`` for multi-head latent attention); ``layouts``
handles the norms and the (dense or MoE) MLP around it and asks the kind for the rest. A family
with two kinds of layers (linear attention and full attention, as Qwen3-Next) registers its new
kind here with ``register_layer_kind`` and returns one name per layer.

GQA rules (Megatron-Core's local spec): ``linear_qkv`` per KV group ``[q(nh/ng*d) k(d) v(d)]``,
tp rank r holds groups ``[r*ng/tp, (r+1)*ng/tp)`` (a contiguous dim-0 chunk); ``linear_proj``
dim-1 chunks; QK-norm weights replicated.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import numpy as np

from . import layouts_deepseek as DS

EXTRA = "_extra_state"
A = "self_attention."


@dataclass(frozen=True)
class LayerKind:
    """Five functions of ``(spec, ...)``; ``prefix`` is the HF layer prefix
    ``model.layers.{i}.``, Megatron keys are relative to ``decoder.layers.{i}.``.

    * ``hf_names(spec, prefix)``: HF names and shapes, in HF module order;
    * ``hf_to_full(spec, get, prefix)``: HF tensors -> full (tp = 1) Megatron tensors;
    * ``full_to_hf(spec, full, prefix)``: the inverse;
    * ``shard(spec, full, tp, t)``: tp rank ``t``'s tensors in Megatron state-dict order,
      ``_extra_state`` entries included;
    * ``merge(spec, part, tp)``: the inverse; ``part(tp_rank, ep_rank, key)`` reads a shard."""

    hf_names: Callable
    hf_to_full: Callable
    full_to_hf: Callable
    shard: Callable
    merge: Callable


LAYER_KINDS: Dict[str, LayerKind] = {}


def register_layer_kind(name: str, kind: LayerKind) -> None:
    if LAYER_KINDS.get(name, kind) is not kind:
        raise ValueError(f"register_layer_kind: {name!r} is already registered")
    LAYER_KINDS[name] = kind


def layer_kind(spec, i: int) -> LayerKind:
    name = spec.kind(i)
    if name not in LAYER_KINDS:
        raise ValueError(f"{spec.family}: layer {i} has checkpoint layout {name!r}, which is not "
                         f"registered (known: {sorted(LAYER_KINDS)})")
    return LAYER_KINDS[name]


def fuse_qkv(q, k, v, ng):
    tail = q.shape[1:]
    return np.concatenate([q.reshape(ng, -1, *tail), k.reshape(ng, -1, *tail),
                           v.reshape(ng, -1, *tail)], axis=1).reshape(-1, *tail)


def split_qkv(qkv, nh, ng, d):
    tail = qkv.shape[1:]
    g = qkv.reshape(ng, (nh // ng + 2) * d, *tail)
    qd = nh // ng * d
    return (g[:, :qd].reshape(-1, *tail), g[:, qd:qd + d].reshape(-1, *tail),
            g[:, qd + d:].reshape(-1, *tail))


# ------------------------------------------------------------------ grouped-query attention
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


register_layer_kind("attention", LayerKind(_gqa_hf_names, _gqa_hf_to_full, _gqa_full_to_hf,
                                           _gqa_shard, _gqa_merge))
register_layer_kind("mla", LayerKind(DS.mla_hf_names, DS.mla_hf_to_full, DS.mla_full_to_hf,
                                     DS.mla_shard, lambda spec, part, tp: DS.mla_merge(spec, part,
                                                                                       tp)))
