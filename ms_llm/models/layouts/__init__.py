"""HF <-> Megatron-Core state-dict layouts: the names, shapes and tensor / expert splits of every
checkpoint tensor, as pure numpy (as torchtitan's per-model state-dict adapters).

They live with the models, not with the checkpoint formats, because they describe a model's
tensors: a family's own layer kinds sit in its folder (``models/families/<name>/layouts.py``)
beside its HF config mapping, and ``ms_llm.checkpoint`` (conversion, Megatron files, HF export,
LoRA merge) only reads and writes files through them.

* ``kinds``: ``LayerKind`` and ``register_layer_kind``, the per-layer token-mixer layouts by name;
  the generic ones here are ``"attention"`` (``attention``: fused QKV) and ``"mla"`` (``mla``);
* ``layers``: one decoder layer (norms, dense / MoE MLP; ``moe``: expert bias, shared experts)
  HF <-> full Megatron <-> tp / ep shards, and the vocabulary-parallel tensors;
* ``mtp``: the multi-token prediction layers;
* ``spec``: ``ModelSpec`` (the layout facts of a family's parsed ``config.json``),
  ``ParallelLayout`` (tp / pp / vpp / ep split) and the ``--model-type-hf`` names.
"""
from __future__ import annotations

from .attention import GQA
from .kinds import LAYER_KINDS, LayerKind, fuse_qkv, layer_kind, register_layer_kind, split_qkv
from .layers import (full_layer_to_hf, hf_layer_names, hf_layer_to_full, hf_names, merge_layer,
                     pad_vocab, shard_layer, vocab_merge, vocab_shards)
from .mla import MLA
from .spec import (ModelSpec, ParallelLayout, default_megatron_name, export_family, family_of,
                   megatron_names, padded_vocab_size, spec_from_hf_config, spec_of_config)

register_layer_kind("attention", GQA)
register_layer_kind("mla", MLA)

__all__ = ["LAYER_KINDS", "LayerKind", "ModelSpec", "ParallelLayout", "default_megatron_name",
           "export_family", "family_of", "full_layer_to_hf", "fuse_qkv", "hf_layer_names",
           "hf_layer_to_full", "hf_names", "layer_kind", "megatron_names", "merge_layer",
           "pad_vocab", "padded_vocab_size", "register_layer_kind", "shard_layer",
           "spec_from_hf_config", "spec_of_config", "split_qkv", "vocab_merge", "vocab_shards"]
