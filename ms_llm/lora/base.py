"""Which base weights a LoRA checkpoint belongs to.

A LoRA training checkpoint stores only the adapters (and buffers, optimizer state, data
position); the frozen base stays in the ``checkpoint.load`` folder. The checkpoint state records
that folder and a SHA-256 fingerprint of its files, so resuming, ``ms-llm export`` and
``ms-llm convert --lora-load`` can refuse a base that changed or was swapped (adapters applied
to other weights silently give a different model). The fingerprint reads every file once
(~1 GB/s: seconds for a 7B model), on rank 0 only, when the first checkpoint is saved.
"""
from __future__ import annotations

import hashlib
import os
from typing import Dict, List, Optional

STATE_KEY = "lora"
# lora.target_modules: the attention / MLP linears, Gated DeltaNet's projections (Qwen3-Next /
# Qwen3.5 hybrid layers) and multi-head latent attention's (DeepSeek-V2/V3: Megatron-Core's
# names, HF q_proj / q_a_proj / q_b_proj / kv_a_proj_with_mqa / kv_b_proj)
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "in_proj_qkvz", "in_proj_ba",
           "out_proj", "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj",
           "linear_kv_down_proj", "linear_kv_up_proj")
# MindSpeed-LLM's latent attention fuses its down-projections ([q_down (or q_proj); kv_down]) into
# one ``linear_qkv``, so its DeepSeek scripts' ``--lora-target-modules linear_qkv`` adapts them;
# ms-llm keeps Megatron-Core's separate linears, and ``linear_qkv`` selects each of them too
# (each with its own rank-r adapter, where MindSpeed's fused one shares A between them).
ALIASES = {"linear_qkv": ("linear_q_down_proj", "linear_q_proj", "linear_kv_down_proj")}
_BLOCK = 1 << 20


def _files(folder: str) -> List[str]:
    out = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and ".tmp" not in d)
        for f in sorted(files):
            if not f.startswith(".") and ".tmp" not in f:
                out.append(os.path.relpath(os.path.join(root, f), folder))
    return out


def fingerprint(folder: str) -> str:
    """SHA-256 over every file's relative path and bytes (hidden and temporary files aside)."""
    h = hashlib.sha256()
    for rel in _files(folder):
        h.update(rel.encode() + b"\0")
        with open(os.path.join(folder, rel), "rb") as f:
            for block in iter(lambda: f.read(_BLOCK), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()


def lora_state(lora_cfg, base_folder: str, modules: List[str],
               base_sha256: Optional[str] = None) -> Dict:
    """The ``lora`` entry of a training checkpoint's state."""
    folder = os.path.abspath(base_folder)
    return {"r": int(lora_cfg.r), "alpha": float(lora_cfg.alpha),
            "dropout": float(lora_cfg.dropout), "target_modules": list(lora_cfg.target_modules),
            "modules": list(modules), "base": folder,
            "base_sha256": base_sha256 or fingerprint(folder)}


def check_base(state: Optional[Dict], folder: str, where: str) -> None:
    """Raise ``ValueError`` unless ``folder`` holds the base the adapters in ``state`` (a
    checkpoint's ``lora`` entry) were trained on."""
    if not state:
        raise ValueError(f"{where}: holds no LoRA adapters (its state has no 'lora' entry)")
    have = fingerprint(folder)
    if have != state.get("base_sha256"):
        raise ValueError(f"{where}: its adapters were trained on base {state.get('base')} "
                         f"(sha256 {str(state.get('base_sha256'))[:12]}...), but {folder} has "
                         f"sha256 {have[:12]}... (a different base)")
