"""``ms-llm export`` of a LoRA training checkpoint (adapters only; the base is the folder its
state records).

* merged (default): the base folder converted with ``--lora-load`` = this checkpoint, i.e.
  ``W + alpha/r B A`` streamed through the converter into an HF (or Megatron) folder; the base's
  tokenizer files are copied beside it (HF base, HF output);
* ``--lora-only``: PEFT's layout, ``adapter_model.safetensors`` + ``adapter_config.json``. A
  fused module's adapter is split into HF's modules: for ``linear_qkv`` each of q/k/v_proj gets
  the shared A and its rows of B (Megatron's per-query-group row order undone as for the weight);
  for ``linear_fc1`` gate_proj and up_proj get A and the two halves of B. Each HF module's delta
  ``B_q A`` is then exactly its rows of the fused delta. PEFT's files have no place for a
  buffer training moved under the frozen base (a router's expert bias, updated every step
  when ``moe_router_bias_update_rate`` > 0): adapters applied to the base would route with the
  base's bias, another model, so such a checkpoint is refused (export it merged).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Dict, List, Optional

import numpy as np

from ms_llm.models import layouts as L
from ms_llm.checkpoint.hf.io import HFWriter
from ms_llm.lora.base import STATE_KEY
from .merge import MODULES, PEFT_PREFIX, modules_for, AdapterError, read_checkpoint_adapters


def export_merged(ckpt: str, out_dir: str, *, fmt: str = "hf", dtype: Optional[str] = None,
                  base: Optional[str] = None, tp: int = 1, pp: int = 1, ep: int = 1,
                  divisible: Optional[int] = None) -> str:
    """Merge the adapters of ``ckpt`` into their base (``base`` overrides the recorded folder;
    its fingerprint must still match) and write an HF or Megatron folder."""
    from ms_llm.checkpoint.convert import convert
    from ms_llm.checkpoint.convert.args import build_parser
    from ms_llm.checkpoint.megatron.io import is_megatron_dir
    ad = read_checkpoint_adapters(ckpt)
    folder = base or ad.state.get("base")
    if not folder or not os.path.isdir(folder):
        raise AdapterError(f"{ckpt}: its base folder {folder} does not exist (pass --base DIR)")
    argv = ["--load-model-type", "mg" if is_megatron_dir(folder) else "hf",
            "--save-model-type", "hf" if fmt == "hf" else "mg", "--load-dir", folder,
            "--save-dir", out_dir, "--lora-load", ckpt]
    if fmt != "hf":
        argv += ["--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size",
                 str(pp), "--target-expert-parallel-size", str(ep)]
        if divisible:
            argv += ["--make-vocab-size-divisible-by", str(divisible)]
    if dtype:
        argv += ["--params-dtype", dtype]
    return convert(build_parser().parse_args(argv))


def _spec_of(state: dict) -> L.ModelSpec:
    from ms_llm.checkpoint.native.export import hf_config_from_transformer_config
    from ms_llm.models.config import TransformerConfig
    if not isinstance(state.get("model_config"), dict):
        raise AdapterError("export --lora-only: the checkpoint state has no model_config")
    hf_cfg, mt = hf_config_from_transformer_config(TransformerConfig(**state["model_config"]))
    return L.spec_from_hf_config(hf_cfg, mt, source="checkpoint model_config")


def peft_tensors(ad, spec: L.ModelSpec) -> Dict[str, np.ndarray]:
    """HF-named PEFT tensors of the fused adapters (see the module docstring)."""
    # fused q/k/v attention and latent attention split into HF modules; Gated DeltaNet's
    # projections and gated attention's q (gate rows) have no per-module split here
    if spec.linear or (spec.config is not None and spec.config.attention_output_gate):
        raise AdapterError(f"export --lora-only: PEFT adapters of a {spec.family} model (gated "
                           f"attention / Gated DeltaNet layers) are not built; export merged "
                           f"weights instead")
    out: Dict[str, np.ndarray] = {}
    for (i, mod), (a, b) in sorted(ad.fused.items()):
        hfs = modules_for(spec)[mod]
        if len(hfs) == 3:
            bs = L.split_qkv(b, spec.heads, spec.groups, spec.head_dim)
        elif len(hfs) == 2:
            bs = np.split(b, 2, axis=0)
        else:
            bs = [b]
        for hf, bpart in zip(hfs, bs):
            key = f"{PEFT_PREFIX}{i}.{hf}"
            out[key + ".lora_A.weight"] = np.ascontiguousarray(a)
            out[key + ".lora_B.weight"] = np.ascontiguousarray(bpart)
    return out


def _target_modules(ad, num_layers: int):
    """PEFT's ``target_modules``: HF module names when every layer has the same adapters,
    else a regex PEFT full-matches against module names."""
    per_layer: Dict[int, set] = {}
    for (i, mod) in ad.fused:
        per_layer.setdefault(i, set()).update(MODULES[mod])
    sets = {frozenset(s) for s in per_layer.values()}
    if len(per_layer) == num_layers and len(sets) == 1:
        return sorted(h.rsplit(".", 1)[-1] for h in next(iter(sets)))
    names = sorted(f"model.layers.{i}.{h}" for i, s in per_layer.items() for h in s)
    return "|".join(re.escape(n) for n in names)


def _refuse_moved_buffers(ad, ckpt: str) -> None:
    """PEFT files cannot carry the buffers training moved (see the module docstring)."""
    if not ad.buffers:
        return
    from ms_llm.checkpoint.convert import HFSource, MegatronSource
    from ms_llm.checkpoint.megatron.io import is_megatron_dir
    folder = ad.state.get("base")
    if not folder or not os.path.isdir(folder):
        raise AdapterError(f"{ckpt}: its base folder {folder} does not exist, so its trained "
                           f"buffers cannot be checked against the base's")
    src = MegatronSource(folder, None) if is_megatron_dir(folder) else HFSource(folder, None)
    for i in sorted({i for i, _ in ad.buffers}):
        full = src.layer(i)
        for (li, key), value in sorted(ad.buffers.items()):
            if li == i and (key not in full or not np.array_equal(
                    np.asarray(full[key], np.float32), np.asarray(value, np.float32))):
                raise AdapterError(f"export --lora-only: {ckpt}: decoder layer {i} {key} was "
                                   f"updated in training (moe_router_bias_update_rate > 0) "
                                   f"and PEFT adapters cannot carry it; export the merged "
                                   f"model instead")


def export_peft(ckpt: str, out_dir: str) -> str:
    """Write ``adapter_model.safetensors`` + ``adapter_config.json`` (PEFT LoRA, CAUSAL_LM)."""
    ad = read_checkpoint_adapters(ckpt)
    spec = _spec_of(ad.checkpoint_state)
    _refuse_moved_buffers(ad, ckpt)
    tensors = peft_tensors(ad, spec)
    out = os.path.abspath(out_dir)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise AdapterError(f"export: {out_dir} exists and is not empty")
    tmp = f"{out.rstrip(os.sep)}.tmp-{os.getpid()}"
    try:
        w = HFWriter(tmp, [(n, t.shape, t.dtype) for n, t in tensors.items()], "1000GB")
        for n, t in tensors.items():
            w.add(n, t)
        w.close()
        os.rename(os.path.join(tmp, "model.safetensors"),
                  os.path.join(tmp, "adapter_model.safetensors"))
        st = ad.state
        cfg = {"alpha_pattern": {}, "auto_mapping": None,
               "base_model_name_or_path": st.get("base"), "bias": "none",
               "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
               "layers_pattern": None, "layers_to_transform": None, "lora_alpha": ad.alpha,
               "lora_dropout": float(st.get("dropout", 0.0)), "modules_to_save": None,
               "peft_type": "LORA", "r": ad.r, "rank_pattern": {}, "revision": None,
               "target_modules": _target_modules(ad, spec.num_layers),
               "task_type": "CAUSAL_LM", "use_dora": False, "use_rslora": False}
        with open(os.path.join(tmp, "adapter_config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
            f.write("\n")
        if os.path.isdir(out):
            os.rmdir(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def is_lora_checkpoint(ckpt: str) -> bool:
    from ms_llm.checkpoint.native.load import DCPReader
    r = DCPReader(ckpt)
    try:
        return bool(r.state.get(STATE_KEY))
    finally:
        r.close()


__all__: List[str] = ["export_merged", "export_peft", "is_lora_checkpoint", "peft_tensors"]
