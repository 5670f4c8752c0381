"""The MoE tensors beside the experts (DeepSeek-V3 / GLM-4.5 / Qwen3-Next routers): the router's
expert bias, the shared experts and the shared expert's gate, HF <-> Megatron-Core.

* ``mlp.router.expert_bias`` = ``mlp.gate.e_score_correction_bias``;
* ``mlp.shared_experts.linear_fc1`` = ``[gate_proj; up_proj]`` of the HF shared expert
  (``spec.hf_shared``), ``mlp.shared_experts.linear_fc2`` = its ``down_proj``; tensor parallel
  splits them like the dense MLP;
* ``mlp.shared_experts.gate_weight`` = ``mlp.shared_expert_gate.weight`` (replicated).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Dict, List, Tuple

import numpy as np


def moe_extra_hf_names(spec, prefix: str) -> List[Tuple[str, tuple]]:
    out = []
    if spec.expert_bias:
        out.append((prefix + "mlp.gate.e_score_correction_bias", (spec.num_experts,)))
    if spec.shared_ffn:
        s, H, F = prefix + spec.hf_shared, spec.hidden, spec.shared_ffn
        out += [(s + "gate_proj.weight", (F, H)), (s + "up_proj.weight", (F, H)),
                (s + "down_proj.weight", (H, F))]
    if spec.shared_gate:
        out.append((prefix + "mlp.shared_expert_gate.weight", (1, spec.hidden)))
    return out


def moe_extra_hf_to_full(spec, get: Callable[[str], np.ndarray], prefix: str) -> Dict:
    out = OrderedDict()
    if spec.expert_bias:
        out["mlp.router.expert_bias"] = get(prefix + "mlp.gate.e_score_correction_bias")
    if spec.shared_ffn:
        s = prefix + spec.hf_shared
        out["mlp.shared_experts.linear_fc1.weight"] = np.concatenate(
            [get(s + "gate_proj.weight"), get(s + "up_proj.weight")], axis=0)
        out["mlp.shared_experts.linear_fc2.weight"] = get(s + "down_proj.weight")
    if spec.shared_gate:
        out["mlp.shared_experts.gate_weight"] = get(prefix + "mlp.shared_expert_gate.weight")
    return out


def moe_extra_full_to_hf(spec, full: Dict, prefix: str) -> Dict:
    out = {}
    if spec.expert_bias:
        out[prefix + "mlp.gate.e_score_correction_bias"] = full["mlp.router.expert_bias"]
    if spec.shared_ffn:
        s, fc1 = prefix + spec.hf_shared, full["mlp.shared_experts.linear_fc1.weight"]
        out[s + "gate_proj.weight"], out[s + "up_proj.weight"] = np.split(fc1, 2, axis=0)
        out[s + "down_proj.weight"] = full["mlp.shared_experts.linear_fc2.weight"]
    if spec.shared_gate:
        out[prefix + "mlp.shared_expert_gate.weight"] = full["mlp.shared_experts.gate_weight"]
    return out


def moe_extra_shard(spec, full: Dict, tp: int, t: int, fc1_shard) -> "OrderedDict":
    out = OrderedDict()
    if spec.expert_bias:
        out["mlp.router.expert_bias"] = full["mlp.router.expert_bias"]
    if spec.shared_ffn:
        out["mlp.shared_experts.linear_fc1.weight"] = fc1_shard(
            full["mlp.shared_experts.linear_fc1.weight"], tp, t)
        out["mlp.shared_experts.linear_fc1._extra_state"] = None
        out["mlp.shared_experts.linear_fc2.weight"] = np.split(
            full["mlp.shared_experts.linear_fc2.weight"], tp, axis=1)[t]
        out["mlp.shared_experts.linear_fc2._extra_state"] = None
    if spec.shared_gate:
        out["mlp.shared_experts.gate_weight"] = full["mlp.shared_experts.gate_weight"]
    return out


def moe_extra_merge(spec, part: Callable[[int, int, str], np.ndarray], tp: int,
                    fc1_merge) -> "OrderedDict":
    out = OrderedDict()
    if spec.expert_bias:
        out["mlp.router.expert_bias"] = part(0, 0, "mlp.router.expert_bias")
    if spec.shared_ffn:
        out["mlp.shared_experts.linear_fc1.weight"] = fc1_merge(
            [part(t, 0, "mlp.shared_experts.linear_fc1.weight") for t in range(tp)])
        out["mlp.shared_experts.linear_fc2.weight"] = np.concatenate(
            [part(t, 0, "mlp.shared_experts.linear_fc2.weight") for t in range(tp)], axis=1)
    if spec.shared_gate:
        out["mlp.shared_experts.gate_weight"] = part(0, 0, "mlp.shared_experts.gate_weight")
    return out
