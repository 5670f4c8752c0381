"""Qwen3-Next's two checkpoint layer kinds (registered by the package; the family names one per
layer).

``gated_attention``: HF ``q_proj`` holds per head ``[q (d) | gate (d)]``; the model (Megatron-
Core's ``attention_output_gate``) fuses per KV group ``[q (r*d) | gate (r*d) | k (d) | v (d)]``
into ``linear_qkv`` (r = heads per group). The Megatron files keep MindSpeed-LLM's Qwen3-Next
names (its ``qwen3_next_full_attention`` and ``convert_ckpt_v2`` ``qkv_type: mix``): separate
``self_attention.q_proj`` (HF's per-head ``[q | gate]`` rows), ``k_proj``, ``v_proj``, plus
``linear_proj`` and the QK-norms; so ``shard`` unfuses and ``merge`` fuses again. At tp > 1
(MindSpeed's converter refuses it) the three are column-parallel: contiguous dim-0 chunks
(whole heads / KV groups), ``linear_proj`` dim-1 chunks; QK-norm weights replicated.

``gated_delta_net``: the names are HF's under ``self_attention.`` (MindSpeed-LLM's Qwen3-Next
spec keeps ``in_proj_qkvz`` / ``in_proj_ba`` / ``conv1d`` / ``dt_bias`` / ``A_log`` / ``norm`` /
``out_proj``). Tensor parallel splits by key-head groups: ``in_proj_qkvz`` / ``in_proj_ba`` rows
are grouped per key head already (dim-0 chunks); the conv channels are ``[q | k | v]`` (each
part chunked); ``dt_bias`` / ``A_log`` by value head; ``out_proj`` dim-1 chunks; the gated norm
(per value head) is replicated.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Dict, List, Tuple

import numpy as np

from ...layouts.kinds import A, EXTRA, LayerKind

HF_ATTN, HF_LIN = "self_attn.", "linear_attn."
GDN = ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "dt_bias", "A_log",
       "norm.weight", "out_proj.weight")


# ----------------------------------------------------------------------------- gated attention
def _ga_hf_names(spec, p: str) -> List[Tuple[str, tuple]]:
    H, d, a = spec.hidden, spec.head_dim, p + HF_ATTN
    return [(a + "q_proj.weight", (2 * spec.heads * d, H)),
            (a + "k_proj.weight", (spec.groups * d, H)),
            (a + "v_proj.weight", (spec.groups * d, H)),
            (a + "o_proj.weight", (H, spec.heads * d)),
            (a + "q_norm.weight", (d,)), (a + "k_norm.weight", (d,))]


def _ga_hf_to_full(spec, get: Callable[[str], np.ndarray], p: str) -> Dict:
    a, ng, d = p + HF_ATTN, spec.groups, spec.head_dim
    H = spec.hidden
    qg = get(a + "q_proj.weight").reshape(ng, spec.heads // ng, 2, d, H)
    q, gate = qg[:, :, 0].reshape(ng, -1, H), qg[:, :, 1].reshape(ng, -1, H)
    k = get(a + "k_proj.weight").reshape(ng, d, H)
    v = get(a + "v_proj.weight").reshape(ng, d, H)
    full = OrderedDict()
    full[A + "linear_proj.weight"] = get(a + "o_proj.weight")
    full[A + "linear_qkv.weight"] = np.concatenate([q, gate, k, v], axis=1).reshape(-1, H)
    full[A + "q_layernorm.weight"] = get(a + "q_norm.weight")
    full[A + "k_layernorm.weight"] = get(a + "k_norm.weight")
    return full


def _ga_full_to_hf(spec, full: Dict, p: str) -> Dict:
    a, ng, d, H = p + HF_ATTN, spec.groups, spec.head_dim, spec.hidden
    r = spec.heads // ng
    g = full[A + "linear_qkv.weight"].reshape(ng, (2 * r + 2) * d, H)
    q = g[:, :r * d].reshape(ng, r, 1, d, H)
    gate = g[:, r * d:2 * r * d].reshape(ng, r, 1, d, H)
    return {a + "q_proj.weight": np.concatenate([q, gate], axis=2).reshape(-1, H),
            a + "k_proj.weight": np.ascontiguousarray(g[:, 2 * r * d:(2 * r + 1) * d]
                                                      .reshape(-1, H)),
            a + "v_proj.weight": np.ascontiguousarray(g[:, (2 * r + 1) * d:].reshape(-1, H)),
            a + "o_proj.weight": full[A + "linear_proj.weight"],
            a + "q_norm.weight": full[A + "q_layernorm.weight"],
            a + "k_norm.weight": full[A + "k_layernorm.weight"]}


MS_ATTN = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "linear_proj.weight")


def _ga_shard(spec, full: Dict, tp: int, t: int) -> "OrderedDict":
    hf = _ga_full_to_hf(spec, full, "")
    out = OrderedDict()
    for n in MS_ATTN:
        w = hf[HF_ATTN + ("o_proj.weight" if n == "linear_proj.weight" else n)]
        out[A + n] = np.split(w, tp, axis=1 if n == "linear_proj.weight" else 0)[t]
        out[A + n[:-len("weight")] + EXTRA] = None
    out[A + "q_layernorm.weight"] = full[A + "q_layernorm.weight"]
    out[A + "k_layernorm.weight"] = full[A + "k_layernorm.weight"]
    return out


def _ga_merge(spec, part, tp: int) -> "OrderedDict":
    hf = {HF_ATTN + ("o_proj.weight" if n == "linear_proj.weight" else n): np.concatenate(
        [part(t, 0, A + n) for t in range(tp)], axis=1 if n == "linear_proj.weight" else 0)
        for n in MS_ATTN}
    hf[HF_ATTN + "q_norm.weight"] = part(0, 0, A + "q_layernorm.weight")
    hf[HF_ATTN + "k_norm.weight"] = part(0, 0, A + "k_layernorm.weight")
    return _ga_hf_to_full(spec, hf.__getitem__, "")


# ----------------------------------------------------------------------------- Gated DeltaNet
def _gdn_shapes(spec) -> Dict[str, tuple]:
    hk, hv, dk, dv, kernel = spec.linear
    H = spec.hidden
    return {"in_proj_qkvz.weight": (2 * hk * dk + 2 * hv * dv, H),
            "in_proj_ba.weight": (2 * hv, H), "conv1d.weight": (2 * hk * dk + hv * dv, 1, kernel),
            "dt_bias": (hv,), "A_log": (hv,), "norm.weight": (dv,),
            "out_proj.weight": (H, hv * dv)}


def _gdn_hf_names(spec, p: str) -> List[Tuple[str, tuple]]:
    shapes = _gdn_shapes(spec)
    return [(p + HF_LIN + n, shapes[n]) for n in sorted(GDN)]


def _gdn_hf_to_full(spec, get, p: str) -> Dict:
    return OrderedDict((A + n, get(p + HF_LIN + n)) for n in GDN)


def _gdn_full_to_hf(spec, full: Dict, p: str) -> Dict:
    return {p + HF_LIN + n: full[A + n] for n in GDN}


def _conv_parts(spec) -> List[int]:
    hk, hv, dk, dv, _ = spec.linear
    return [hk * dk, 2 * hk * dk]            # split points of [q | k | v]


def _gdn_shard(spec, full: Dict, tp: int, t: int) -> "OrderedDict":
    out = OrderedDict()
    for n in GDN:
        w = full[A + n]
        if n in ("in_proj_qkvz.weight", "in_proj_ba.weight", "dt_bias", "A_log"):
            w = np.split(w, tp, axis=0)[t]
        elif n == "conv1d.weight":
            w = np.concatenate([np.split(x, tp, axis=0)[t]
                                for x in np.split(w, _conv_parts(spec), axis=0)], axis=0)
        elif n == "out_proj.weight":
            w = np.split(w, tp, axis=1)[t]
        out[A + n] = w
        if n.endswith("proj.weight"):
            out[A + n[:-len("weight")] + EXTRA] = None
    return out


def _gdn_merge(spec, part, tp: int) -> "OrderedDict":
    full = OrderedDict()
    for n in GDN:
        parts = [part(t, 0, A + n) for t in range(tp)]
        if n in ("in_proj_qkvz.weight", "in_proj_ba.weight", "dt_bias", "A_log"):
            w = np.concatenate(parts, axis=0)
        elif n == "conv1d.weight":
            pieces = [np.split(x, [s // tp for s in _conv_parts(spec)], axis=0) for x in parts]
            w = np.concatenate([x[j] for j in range(3) for x in pieces], axis=0)
        elif n == "out_proj.weight":
            w = np.concatenate(parts, axis=1)
        else:
            w = parts[0]
        full[A + n] = w
    return full


GATED_ATTENTION = LayerKind(_ga_hf_names, _ga_hf_to_full, _ga_full_to_hf, _ga_shard, _ga_merge)
GATED_DELTA_NET = LayerKind(_gdn_hf_names, _gdn_hf_to_full, _gdn_full_to_hf, _gdn_shard,
                            _gdn_merge)
