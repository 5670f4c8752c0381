"""The token-mixing part of a decoder layer in each checkpoint layout (``LayerKind``), by name.

A family names each layer's kind (``FamilySpec.layer_kinds``: ``"attention"`` for grouped-query
attention with a fused ``linear_qkv``, ``"mla"`` for multi-head latent attention, both registered
by this package); ``layers`` handles the norms and the (dense or MoE) MLP around it and asks the
kind for the rest. A family with its own kinds of layers (linear attention and gated attention, as
Qwen3-Next) keeps their layouts in its folder (``families/<name>/layouts.py``), registers them
with ``register_layer_kind`` from its package ``__init__`` and returns one name per layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict

import numpy as np

from ..registry import families

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
    """The layout of layer ``i``. A family registers its own kinds when its package is
    imported, so a name not known yet first loads the built-in families."""
    name = spec.kind(i)
    if name not in LAYER_KINDS:
        families()
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
