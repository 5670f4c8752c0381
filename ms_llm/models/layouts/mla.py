"""Multi-head latent attention (layer kind ``"mla"``, DeepSeek-V3): HF <-> Megatron-Core names.

Megatron-Core keys (relative to ``decoder.layers.{i}.``) and their HF names:

* ``self_attention.linear_q_down_proj`` = ``self_attn.q_a_proj`` (+ ``.bias`` with
  ``attention_bias``), ``self_attention.q_layernorm`` = ``q_a_layernorm``,
  ``self_attention.linear_q_up_proj`` = ``q_b_proj``; without ``q_lora_rank``
  ``self_attention.linear_q_proj`` = ``q_proj``;
* ``self_attention.linear_kv_down_proj`` = ``kv_a_proj_with_mqa`` (+ bias),
  ``self_attention.kv_layernorm`` = ``kv_a_layernorm``, ``self_attention.linear_kv_up_proj`` =
  ``kv_b_proj``, ``self_attention.linear_proj`` = ``o_proj`` (+ bias).

On disk (Megatron checkpoint files) the MLA tensors of a model with ``q_lora_rank`` take
MindSpeed-LLM's names, so its DeepSeek-V3 checkpoints load and ours load there:
``self_attention.linear_qkv`` = ``[linear_q_down_proj; linear_kv_down_proj]`` rows,
``linear_qb`` / ``linear_kvb`` = the up-projections, ``k_layernorm`` = ``kv_layernorm``; reading
also accepts the Megatron-Core names. Tensor parallel: the up-projections (and
``linear_q_proj``) split their rows by whole heads (dim 0), ``linear_proj`` its columns (dim 1);
the down-projections, their norms and all biases but none of the up-projections' are
replicated.
Weights are kept exactly as released (DeepSeek's interleaved rope rows included: the model
de-interleaves at run time, as Megatron-Core's MLA does), so HF -> Megatron -> HF is bit-exact.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Dict, List, Tuple

import numpy as np

from .kinds import A, LayerKind


# ------------------------------------------------------------------------------------ MLA
def _mla_pairs(spec) -> List[Tuple[str, str, tuple]]:
    """(Megatron key, HF name under ``self_attn.``, HF shape) in HF module order."""
    H, nh = spec.hidden, spec.heads
    qd = spec.qk_nope + spec.qk_rope
    out = []
    if spec.q_lora_rank:
        out.append((A + "linear_q_down_proj.weight", "q_a_proj.weight", (spec.q_lora_rank, H)))
        if spec.attn_bias:
            out.append((A + "linear_q_down_proj.bias", "q_a_proj.bias", (spec.q_lora_rank,)))
        out += [(A + "q_layernorm.weight", "q_a_layernorm.weight", (spec.q_lora_rank,)),
                (A + "linear_q_up_proj.weight", "q_b_proj.weight", (nh * qd, spec.q_lora_rank))]
    else:
        out.append((A + "linear_q_proj.weight", "q_proj.weight", (nh * qd, H)))
    kv_a = spec.kv_lora_rank + spec.qk_rope
    out.append((A + "linear_kv_down_proj.weight", "kv_a_proj_with_mqa.weight", (kv_a, H)))
    if spec.attn_bias:
        out.append((A + "linear_kv_down_proj.bias", "kv_a_proj_with_mqa.bias", (kv_a,)))
    out += [(A + "kv_layernorm.weight", "kv_a_layernorm.weight", (spec.kv_lora_rank,)),
            (A + "linear_kv_up_proj.weight", "kv_b_proj.weight",
             (nh * (spec.qk_nope + spec.v_head), spec.kv_lora_rank)),
            (A + "linear_proj.weight", "o_proj.weight", (H, nh * spec.v_head))]
    if spec.attn_bias:
        out.append((A + "linear_proj.bias", "o_proj.bias", (H,)))
    return out


# Row-split (dim 0) and column-split (dim 1) MLA tensors; everything else is replicated.
_MLA_ROWS = (A + "linear_q_up_proj.weight", A + "linear_q_proj.weight",
             A + "linear_kv_up_proj.weight")
_MLA_COLS = (A + "linear_proj.weight",)


def mla_hf_names(spec, prefix: str) -> List[Tuple[str, tuple]]:
    return [(prefix + "self_attn." + hf, shape) for _, hf, shape in _mla_pairs(spec)]


def mla_hf_to_full(spec, get: Callable[[str], np.ndarray], prefix: str) -> Dict:
    return OrderedDict((mg, get(prefix + "self_attn." + hf)) for mg, hf, _ in _mla_pairs(spec))


def mla_full_to_hf(spec, full: Dict, prefix: str) -> Dict:
    return {prefix + "self_attn." + hf: full[mg] for mg, hf, _ in _mla_pairs(spec)}


# MindSpeed-LLM's on-disk names for DeepSeek-V3 with ``q_lora_rank`` (its convert_ckpt_deepseek3):
# the two down-projections fused as ``linear_qkv`` ([q_down; kv_down] rows, replicated), the
# up-projections as ``linear_qb`` / ``linear_kvb`` and ``kv_layernorm`` as ``k_layernorm``.
# Without ``q_lora_rank`` the Megatron-Core names are written.
_MINDSPEED = {A + "linear_q_up_proj.weight": A + "linear_qb.weight",
              A + "linear_kv_up_proj.weight": A + "linear_kvb.weight",
              A + "kv_layernorm.weight": A + "k_layernorm.weight"}
_DOWN = (A + "linear_q_down_proj.", A + "linear_kv_down_proj.")


def mla_shard(spec, full: Dict, tp: int, t: int) -> "OrderedDict":
    """Megatron shard ``t`` of ``tp`` in MindSpeed's layout (see ``_MINDSPEED``)."""
    out = OrderedDict()
    fused = bool(spec.q_lora_rank)
    for mg, _, _ in _mla_pairs(spec):
        x = full[mg]
        if mg in _MLA_ROWS:
            x = np.split(x, tp, axis=0)[t]
        elif mg in _MLA_COLS:
            x = np.split(x, tp, axis=1)[t]
        if fused and mg.startswith(_DOWN):
            if mg.startswith(_DOWN[1]):
                continue
            part = mg[len(_DOWN[0]):]                               # "weight" / "bias"
            out[A + "linear_qkv." + part] = np.concatenate(
                [full[_DOWN[0] + part], full[_DOWN[1] + part]], axis=0)
            if part == "weight":
                out[A + "linear_qkv._extra_state"] = None
            continue
        key = _MINDSPEED.get(mg, mg) if fused else mg
        out[key] = x
        if key.endswith("proj.weight") or key.endswith("b.weight"):
            out[key[:-len("weight")] + "_extra_state"] = None
    return out


def mla_merge(spec, part: Callable[[int, int, str], np.ndarray], tp: int) -> "OrderedDict":
    """Inverse of ``mla_shard``; also reads Megatron-Core's own names (``linear_q_down_proj``
    ...), which Megatron-LM writes."""
    fused = bool(spec.q_lora_rank)
    try:
        if fused:
            part(0, 0, A + "linear_qkv.weight")
    except KeyError:
        fused = False                                              # Megatron-Core names
    out = OrderedDict()
    for mg, _, _ in _mla_pairs(spec):
        if fused and mg.startswith(_DOWN):
            name = mg[len(_DOWN[0] if mg.startswith(_DOWN[0]) else _DOWN[1]):]
            both = part(0, 0, A + "linear_qkv." + name)
            out[mg] = both[:spec.q_lora_rank] if mg.startswith(_DOWN[0]) \
                else both[spec.q_lora_rank:]
            continue
        key = _MINDSPEED.get(mg, mg) if fused else mg
        if mg in _MLA_ROWS or mg in _MLA_COLS:
            axis = 0 if mg in _MLA_ROWS else 1
            out[mg] = np.concatenate([part(t, 0, key) for t in range(tp)], axis=axis)
        else:
            out[mg] = part(0, 0, key)
    return out


# LoRA on latent attention (``checkpoint.adapters``): Megatron module (under
# ``decoder.layers.{i}.``) -> the one HF module it is. No linear is fused or reordered here
# (the weights keep HF's rows), so an adapter's B keeps its rows in the PEFT export too.
MLA_LORA_MODULES = OrderedDict([
    ("self_attention.linear_q_proj", ("self_attn.q_proj",)),
    ("self_attention.linear_q_down_proj", ("self_attn.q_a_proj",)),
    ("self_attention.linear_q_up_proj", ("self_attn.q_b_proj",)),
    ("self_attention.linear_kv_down_proj", ("self_attn.kv_a_proj_with_mqa",)),
    ("self_attention.linear_kv_up_proj", ("self_attn.kv_b_proj",)),
    ("self_attention.linear_proj", ("self_attn.o_proj",)),
])

MLA = LayerKind(mla_hf_names, mla_hf_to_full, mla_full_to_hf, mla_shard, mla_merge)
