"""Qwen3.5's Gated DeltaNet checkpoint layer kind (``gated_delta_net_split``; HF
``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``).

Qwen3.5 stores the DeltaNet input projections split and flat: ``in_proj_qkv`` rows ``[q (hk*dk)
| k (hk*dk) | v (hv*dv)]``, ``in_proj_z`` ``[hv*dv]``, ``in_proj_b`` / ``in_proj_a`` ``[hv]``.
The model (and its Megatron checkpoint) keeps Qwen3-Next's / MindSpeed-LLM's fused per key-head
groups, ``in_proj_qkvz`` = per group ``[q_g | k_g | v_g (r*dv) | z_g (r*dv)]`` and
``in_proj_ba`` = per group ``[b_g (r) | a_g (r)]`` (r = value heads per key head; value head
``h`` belongs to group ``h // r`` in both models, as both repeat q/k by interleaving). So the
two layouts are a row permutation of each other (bit-exact both ways), and tensor parallel,
LoRA, MXFP8 and the plan of the fused module apply unchanged. The conv channels are ``[q | k |
v]`` in both, so ``conv1d`` and the other tensors copy through.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Tuple

import numpy as np

from ...layouts.kinds import A, LayerKind
from ..qwen3_next.layouts import GDN, HF_LIN, _gdn_merge, _gdn_shapes, _gdn_shard

SPLIT = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")
SAME = tuple(n for n in GDN if not n.startswith("in_proj_"))


def _hf_shapes(spec) -> Dict[str, tuple]:
    hk, hv, dk, dv, _ = spec.linear
    H = spec.hidden
    shapes = {n: s for n, s in _gdn_shapes(spec).items() if n in SAME}
    shapes.update({"in_proj_qkv.weight": (2 * hk * dk + hv * dv, H),
                   "in_proj_z.weight": (hv * dv, H), "in_proj_b.weight": (hv, H),
                   "in_proj_a.weight": (hv, H)})
    return shapes


def _hf_names(spec, p: str) -> List[Tuple[str, tuple]]:
    shapes = _hf_shapes(spec)
    return [(p + HF_LIN + n, shapes[n]) for n in sorted(shapes)]


def _hf_to_full(spec, get, p: str) -> Dict:
    hk, hv, dk, dv, _ = spec.linear
    r, H = hv // hk, spec.hidden
    qkv = get(p + HF_LIN + "in_proj_qkv.weight")
    q, k, v = np.split(qkv, [hk * dk, 2 * hk * dk], axis=0)
    z = get(p + HF_LIN + "in_proj_z.weight")
    qkvz = np.concatenate([q.reshape(hk, dk, H), k.reshape(hk, dk, H),
                           v.reshape(hk, r * dv, H), z.reshape(hk, r * dv, H)], axis=1)
    b = get(p + HF_LIN + "in_proj_b.weight").reshape(hk, r, H)
    a = get(p + HF_LIN + "in_proj_a.weight").reshape(hk, r, H)
    full = OrderedDict()
    for n in GDN:
        if n == "in_proj_qkvz.weight":
            full[A + n] = qkvz.reshape(-1, H)
        elif n == "in_proj_ba.weight":
            full[A + n] = np.concatenate([b, a], axis=1).reshape(-1, H)
        else:
            full[A + n] = get(p + HF_LIN + n)
    return full


def _full_to_hf(spec, full: Dict, p: str) -> Dict:
    hk, hv, dk, dv, _ = spec.linear
    r, H = hv // hk, spec.hidden
    g = full[A + "in_proj_qkvz.weight"].reshape(hk, 2 * dk + 2 * r * dv, H)
    q, k, v, z = np.split(g, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
    ba = full[A + "in_proj_ba.weight"].reshape(hk, 2 * r, H)
    out = {p + HF_LIN + "in_proj_qkv.weight": np.concatenate(
               [q.reshape(-1, H), k.reshape(-1, H), v.reshape(-1, H)], axis=0),
           p + HF_LIN + "in_proj_z.weight": np.ascontiguousarray(z.reshape(-1, H)),
           p + HF_LIN + "in_proj_b.weight": np.ascontiguousarray(ba[:, :r].reshape(-1, H)),
           p + HF_LIN + "in_proj_a.weight": np.ascontiguousarray(ba[:, r:].reshape(-1, H))}
    out.update({p + HF_LIN + n: full[A + n] for n in SAME})
    return out


GATED_DELTA_NET_SPLIT = LayerKind(_hf_names, _hf_to_full, _full_to_hf, _gdn_shard, _gdn_merge)
