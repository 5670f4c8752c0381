"""HF <-> Megatron-Core (local spec) tensors of one decoder layer, with tp / ep splits, and the
vocabulary-parallel embedding / output layer.

Every conversion goes through one *full* per-layer form: Megatron-Core local-spec keys relative to
``decoder.layers.{i}.`` at tp = ep = 1, with MoE experts under their global id
(``mlp.experts.local_experts.{e}``). ``hf_layer_to_full`` / ``full_layer_to_hf`` translate names
and fuse QKV / gate-up; ``shard_layer`` / ``merge_layer`` apply and undo tensor and expert
parallelism (and the ``--moe-grouped-gemm`` layout). Working one layer at a time is what keeps
conversion memory at the size of a layer, not of the model.

Layout rules (Megatron-Core's local spec and its legacy checkpoint loader):

* ``linear_qkv``: per KV group ``[q(nh/ng*d) k(d) v(d)]``; tp rank r holds groups
  ``[r*ng/tp, (r+1)*ng/tp)`` (a contiguous dim-0 chunk).
* ``linear_fc1``: tp rank r holds ``[gate_r; up_r]`` (r-th chunks of gate and up).
* ``linear_proj`` / ``linear_fc2``: dim-1 chunks; norms and the router are replicated.
* word embeddings / output layer: vocab (dim 0) chunks after zero-padding the vocab.
* experts: ep rank q holds global experts ``[q*E/ep, (q+1)*E/ep)`` as local ids ``0..E/ep-1``;
  expert linears split over tp like the dense MLP (expert-tensor-parallel size = tp).
  Grouped GEMM: ``weight1 = stack_e([gate_r; up_r]_e.T)`` ([E_l, H, 2F/tp]) stored
  ``reshape(H, -1)``; ``weight2 = stack_e(fc2_e[:, r-chunk].T)`` ([E_l, F/tp, H]) stored
  ``reshape(-1, H)`` -- the memory layout Megatron's ``GroupedMLP`` views back.
* Megatron's ``state_dict()`` has ``<linear>._extra_state = None`` for every parallel linear
  (and the output layer); shards carry them so Megatron can load with ``strict=True``.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from . import moe as MOE
from . import mtp as MTP
from .kinds import EXTRA, layer_kind
from .spec import ModelSpec, ParallelLayout

# --------------------------------------------------------------------------------------------
# HF <-> full layer
# --------------------------------------------------------------------------------------------

def hf_layer_names(spec: ModelSpec, i: int) -> List[Tuple[str, tuple]]:
    """HF tensor names and shapes of layer ``i`` in HF module order."""
    p = f"model.layers.{i}."
    return layer_kind(spec, i).hf_names(spec, p) + _mlp_hf_names(spec, i, p)


def _mlp_hf_names(spec: ModelSpec, i: int, p: str) -> List[Tuple[str, tuple]]:
    H, out = spec.hidden, []
    if spec.is_moe(i):
        F = spec.moe_ffn
        out.append((p + "mlp.gate.weight", (spec.num_experts, H)))
        out += MOE.moe_extra_hf_names(spec, p)
        for e in range(spec.num_experts):
            q = f"{p}mlp.experts.{e}."
            out += [(q + "gate_proj.weight", (F, H)), (q + "up_proj.weight", (F, H)),
                    (q + "down_proj.weight", (H, F))]
    else:
        F = spec.ffn
        out += [(p + "mlp.gate_proj.weight", (F, H)), (p + "mlp.up_proj.weight", (F, H)),
                (p + "mlp.down_proj.weight", (H, F))]
    out += [(p + "input_layernorm.weight", (H,)), (p + "post_attention_layernorm.weight", (H,))]
    return out


def hf_names(spec: ModelSpec) -> List[Tuple[str, tuple]]:
    """All HF tensor names and shapes in the order ``save_pretrained`` writes them."""
    out = [("model.embed_tokens.weight", (spec.vocab, spec.hidden))]
    for i in range(spec.num_layers):
        out += hf_layer_names(spec, i)
    for j in range(spec.mtp_layers):
        out += MTP.mtp_hf_names(spec, j, hf_layer_names)
    out.append(("model.norm.weight", (spec.hidden,)))
    if not spec.tied:
        out.append(("lm_head.weight", (spec.vocab, spec.hidden)))
    return out


def hf_layer_to_full(spec: ModelSpec, get: Callable[[str], np.ndarray], i: int) -> Dict:
    """HF tensors of layer ``i`` -> full Megatron layer (relative keys, global expert ids)."""
    p = f"model.layers.{i}."
    full = OrderedDict()
    full["input_layernorm.weight"] = get(p + "input_layernorm.weight")
    full.update(layer_kind(spec, i).hf_to_full(spec, get, p))
    return _mlp_hf_to_full(spec, get, i, p, full)


def _mlp_hf_to_full(spec: ModelSpec, get: Callable[[str], np.ndarray], i: int, p: str,
                    full: Dict) -> Dict:
    full["pre_mlp_layernorm.weight"] = get(p + "post_attention_layernorm.weight")
    if spec.is_moe(i):
        full["mlp.router.weight"] = get(p + "mlp.gate.weight")
        full.update(MOE.moe_extra_hf_to_full(spec, get, p))
        for e in range(spec.num_experts):
            q, m = f"{p}mlp.experts.{e}.", f"mlp.experts.local_experts.{e}."
            full[m + "linear_fc1.weight"] = np.concatenate(
                [get(q + "gate_proj.weight"), get(q + "up_proj.weight")], axis=0)
            full[m + "linear_fc2.weight"] = get(q + "down_proj.weight")
    else:
        full["mlp.linear_fc1.weight"] = np.concatenate(
            [get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")], axis=0)
        full["mlp.linear_fc2.weight"] = get(p + "mlp.down_proj.weight")
    return full


def full_layer_to_hf(spec: ModelSpec, full: Dict, i: int) -> Dict[str, np.ndarray]:
    """Inverse of ``hf_layer_to_full`` (HF names of layer ``i``)."""
    p = f"model.layers.{i}."
    hf = {p + "input_layernorm.weight": full["input_layernorm.weight"],
          p + "post_attention_layernorm.weight": full["pre_mlp_layernorm.weight"]}
    hf.update(layer_kind(spec, i).full_to_hf(spec, full, p))
    return _mlp_full_to_hf(spec, full, i, p, hf)


def _mlp_full_to_hf(spec: ModelSpec, full: Dict, i: int, p: str, hf: Dict) -> Dict:
    if spec.is_moe(i):
        hf[p + "mlp.gate.weight"] = full["mlp.router.weight"]
        hf.update(MOE.moe_extra_full_to_hf(spec, full, p))
        for e in range(spec.num_experts):
            m = f"mlp.experts.local_experts.{e}."
            fc1 = full[m + "linear_fc1.weight"]
            F = fc1.shape[0] // 2
            hf[f"{p}mlp.experts.{e}.gate_proj.weight"] = fc1[:F]
            hf[f"{p}mlp.experts.{e}.up_proj.weight"] = fc1[F:]
            hf[f"{p}mlp.experts.{e}.down_proj.weight"] = full[m + "linear_fc2.weight"]
    else:
        fc1 = full["mlp.linear_fc1.weight"]
        F = fc1.shape[0] // 2
        hf[p + "mlp.gate_proj.weight"] = fc1[:F]
        hf[p + "mlp.up_proj.weight"] = fc1[F:]
        hf[p + "mlp.down_proj.weight"] = full["mlp.linear_fc2.weight"]
    return hf


# --------------------------------------------------------------------------------------------
# full layer <-> tp / ep shards
# --------------------------------------------------------------------------------------------

def _fc1_shard(fc1: np.ndarray, tp: int, r: int) -> np.ndarray:
    gate, up = np.split(fc1, 2, axis=0)
    return np.concatenate([np.split(gate, tp, axis=0)[r], np.split(up, tp, axis=0)[r]], axis=0)


def _fc1_merge(parts: List[np.ndarray]) -> np.ndarray:
    halves = [np.split(x, 2, axis=0) for x in parts]
    return np.concatenate([h[0] for h in halves] + [h[1] for h in halves], axis=0)


def shard_layer(spec: ModelSpec, lay: ParallelLayout, full: Dict, hf_layer: int
                ) -> Dict[Tuple[int, int], "OrderedDict[str, Optional[np.ndarray]]"]:
    """Full layer -> ``{(tp_rank, ep_rank): relative keys in Megatron state-dict order}``."""
    tp, ep = lay.tp, lay.ep
    out = {}
    for t in range(tp):
        dense = OrderedDict()
        dense["input_layernorm.weight"] = full["input_layernorm.weight"]
        dense.update(layer_kind(spec, hf_layer).shard(spec, full, tp, t))
        dense["pre_mlp_layernorm.weight"] = full["pre_mlp_layernorm.weight"]
        if not spec.is_moe(hf_layer):
            dense["mlp.linear_fc1.weight"] = _fc1_shard(full["mlp.linear_fc1.weight"], tp, t)
            dense["mlp.linear_fc1." + EXTRA] = None
            dense["mlp.linear_fc2.weight"] = np.split(full["mlp.linear_fc2.weight"], tp,
                                                      axis=1)[t]
            dense["mlp.linear_fc2." + EXTRA] = None
            for q in range(ep):
                out[(t, q)] = dense
            continue
        n_local = spec.num_experts // ep
        for q in range(ep):
            sd = OrderedDict(dense)
            sd["mlp.router.weight"] = full["mlp.router.weight"]
            sd.update(MOE.moe_extra_shard(spec, full, tp, t, _fc1_shard))
            _experts_shard(spec, lay, full, t, q, n_local, sd)
            out[(t, q)] = sd
    return out


def _experts_shard(spec: ModelSpec, lay: ParallelLayout, full: Dict, t: int, q: int,
                   n_local: int, sd: Dict) -> None:
    tp = lay.tp
    fc1 = [_fc1_shard(full[f"mlp.experts.local_experts.{q * n_local + j}.linear_fc1."
                           f"weight"], tp, t) for j in range(n_local)]
    fc2 = [np.split(full[f"mlp.experts.local_experts.{q * n_local + j}.linear_fc2."
                         f"weight"], tp, axis=1)[t] for j in range(n_local)]
    if lay.grouped_gemm:
        H = spec.hidden
        sd["mlp.experts.weight1"] = np.ascontiguousarray(
            np.stack([w.T for w in fc1])).reshape(H, -1)
        sd["mlp.experts.weight2"] = np.ascontiguousarray(
            np.stack([w.T for w in fc2])).reshape(-1, H)
    else:
        for j in range(n_local):
            m = f"mlp.experts.local_experts.{j}."
            sd[m + "linear_fc1.weight"] = fc1[j]
            sd[m + "linear_fc1." + EXTRA] = None
            sd[m + "linear_fc2.weight"] = fc2[j]
            sd[m + "linear_fc2." + EXTRA] = None


def merge_layer(spec: ModelSpec, lay: ParallelLayout, part: Callable[[int, int, str], np.ndarray],
                hf_layer: int) -> Dict:
    """Inverse of ``shard_layer``: ``part(tp_rank, ep_rank, relative_key)`` reads one shard."""
    tp = lay.tp
    full = OrderedDict()
    full["input_layernorm.weight"] = part(0, 0, "input_layernorm.weight")
    full.update(layer_kind(spec, hf_layer).merge(spec, part, tp))
    full["pre_mlp_layernorm.weight"] = part(0, 0, "pre_mlp_layernorm.weight")
    if not spec.is_moe(hf_layer):
        full["mlp.linear_fc1.weight"] = _fc1_merge([part(t, 0, "mlp.linear_fc1.weight")
                                                    for t in range(tp)])
        full["mlp.linear_fc2.weight"] = np.concatenate(
            [part(t, 0, "mlp.linear_fc2.weight") for t in range(tp)], axis=1)
        return full
    full["mlp.router.weight"] = part(0, 0, "mlp.router.weight")
    full.update(MOE.moe_extra_merge(spec, part, tp, _fc1_merge))
    _experts_merge(spec, lay, part, full)
    return full


def _experts_merge(spec: ModelSpec, lay: ParallelLayout, part, full: Dict) -> None:
    tp, n_local, H = lay.tp, spec.num_experts // lay.ep, spec.hidden
    for q in range(lay.ep):
        if lay.grouped_gemm:
            w1 = [part(t, q, "mlp.experts.weight1").reshape(n_local, H, -1) for t in range(tp)]
            w2 = [part(t, q, "mlp.experts.weight2").reshape(n_local, -1, H) for t in range(tp)]
            fc1 = [[w1[t][j].T for t in range(tp)] for j in range(n_local)]
            fc2 = [[w2[t][j].T for t in range(tp)] for j in range(n_local)]
        else:
            fc1 = [[part(t, q, f"mlp.experts.local_experts.{j}.linear_fc1.weight")
                    for t in range(tp)] for j in range(n_local)]
            fc2 = [[part(t, q, f"mlp.experts.local_experts.{j}.linear_fc2.weight")
                    for t in range(tp)] for j in range(n_local)]
        for j in range(n_local):
            m = f"mlp.experts.local_experts.{q * n_local + j}."
            full[m + "linear_fc1.weight"] = np.ascontiguousarray(_fc1_merge(fc1[j]))
            full[m + "linear_fc2.weight"] = np.ascontiguousarray(np.concatenate(fc2[j], axis=1))


# --------------------------------------------------------------------------------------------
# Embedding, final norm, output layer
# --------------------------------------------------------------------------------------------

def pad_vocab(w: np.ndarray, padded: int) -> np.ndarray:
    """Zero rows up to ``padded`` (the padding rows never score: their logits are 0)."""
    if w.shape[0] == padded:
        return w
    return np.concatenate([w, np.zeros((padded - w.shape[0],) + w.shape[1:], w.dtype)], axis=0)


def vocab_shards(w: np.ndarray, lay: ParallelLayout) -> List[np.ndarray]:
    return np.split(pad_vocab(w, lay.padded_vocab), lay.tp, axis=0)


def vocab_merge(parts: List[np.ndarray], vocab: int) -> np.ndarray:
    return np.concatenate(parts, axis=0)[:vocab]
