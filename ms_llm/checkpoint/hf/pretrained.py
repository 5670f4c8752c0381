"""``from_pretrained``: build a GPTModel from a Hugging Face folder or a Megatron (legacy torch
format) folder of any tp / pp / vpp / ep layout; ``pretrained_architecture`` reads the
architecture such a folder defines without its weights."""
from __future__ import annotations

import logging
import os
from typing import Optional, Tuple

import numpy as np

from ms_llm.compat import load_state_dict
from ms_llm.compat.dtypes import param_dtype
from ms_llm.models.config import TransformerConfig
from ms_llm.models import layouts as L
from ms_llm.models.registry import family_for_hf, parse_hf_config
from ms_llm.models.gpt import GPTModel
from ms_llm.models.layouts import mtp as MTP

from .io import read_hf_config, read_hf_weights
from ..megatron.io import is_megatron_dir

log = logging.getLogger("ms_llm.checkpoint")


def pretrained_architecture(path: str) -> Tuple[TransformerConfig, str]:
    """The ``TransformerConfig`` and family name (any registered family) that
    ``from_pretrained(path)`` builds, read from the folder's config (and, for a Megatron
    folder, its embedding rows: the padded vocabulary) without loading any weight, so a run can
    take its architecture from the folder before it builds anything."""
    if is_megatron_dir(path):
        from ..convert import MegatronSource
        src = MegatronSource(path, None)
        try:
            fam, cfg = parse_hf_config(src.config, os.path.join(path, "config.json"))
            return cfg.replace(padded_vocab_size=src.lay.padded_vocab), fam.name
        finally:
            src.close()
    fam, cfg = parse_hf_config(read_hf_config(path), os.path.join(path, "config.json"))
    return cfg, fam.name


# (a run config adopting a folder's architecture: ms_llm.config.pretrained)
def from_pretrained(path: str, dtype: Optional[str] = None,
                    config: Optional[TransformerConfig] = None) -> GPTModel:
    """Load a Hugging Face folder (``config.json`` + safetensors, fp32/bf16/fp16) or a Megatron
    checkpoint folder (``latest_checkpointed_iteration.txt`` + ``iter_*/mp_rank_*``) into a
    GPTModel.

    ``dtype`` is the parameter dtype (default float32, which also is the only compute dtype with
    kernels everywhere on CPU); ``config`` overrides the architecture read from config.json.
    A Megatron folder keeps its padded vocabulary (``padded_vocab_size`` = its embedding rows).
    """
    if is_megatron_dir(path):
        return _from_megatron(path, dtype, config)
    hf_cfg = read_hf_config(path)
    cfg = config or parse_hf_config(hf_cfg, os.path.join(path, "config.json"))[1]
    if dtype is not None:
        param_dtype(dtype)  # a floating type's name
        cfg = cfg.replace(params_dtype=dtype)
    hf = read_hf_weights(path)
    # Fuse in fp32: every supported storage dtype converts to fp32 exactly.
    hf32 = {k: np.asarray(v, dtype=np.float32) for k, v in hf.items()}
    mcore = _hf_to_mcore(hf32, hf_cfg, cfg, source=path)
    model = GPTModel(cfg)
    load_state_dict(model, mcore, strict=True, source=path)
    log.info("loaded %s: %d parameters", path, model.num_parameters())
    return model


def _from_megatron(path: str, dtype: Optional[str],
                   config: Optional[TransformerConfig]) -> GPTModel:
    """Merge the tp / ep shards and pipeline stages of a Megatron folder one layer at a time
    into the global (tp = pp = 1) Megatron-Core keys GPTModel uses."""
    from ..convert import MegatronSource  # the converter's streaming reader
    src = MegatronSource(path, None)
    try:
        cfg = config or parse_hf_config(src.config, os.path.join(path, "config.json"))[1]
        cfg = cfg.replace(padded_vocab_size=src.lay.padded_vocab)
        if dtype is not None:
            param_dtype(dtype)
            cfg = cfg.replace(params_dtype=dtype)
        model = GPTModel(cfg)
        f32 = lambda x: np.asarray(x, dtype=np.float32)  # noqa: E731  (exact for fp16/bf16)
        sd = {"embedding.word_embeddings.weight": f32(src.embedding(padded=True)),
              "decoder.final_layernorm.weight": f32(src.final_norm())}
        out = src.output(padded=True)
        if out is not None:
            sd["output_layer.weight"] = f32(out)
        for i in range(src.spec.num_layers):
            full = src.layer(i)
            if cfg.moe_grouped_gemm and src.spec.is_moe(i):
                full = experts_to_grouped(full, src.spec.num_experts)
            for k, v in full.items():
                sd[f"decoder.layers.{i}.{k}"] = f32(v)
        depths = mtp_depths(src.spec, cfg, path)
        for j in range(depths):
            sd.update({k: f32(v) for k, v in mtp_state(src.mtp_layer(j), j, cfg,
                                                        src.spec).items()})
        if src.spec.mtp_layers > depths:
            log.warning("%s: skipped MTP depths %d.. (model.mtp_num_layers is %d)", path,
                        depths, depths)
        load_state_dict(model, sd, strict=True, source=path)
    finally:
        src.close()
    log.info("loaded Megatron checkpoint %s (tp=%d pp=%d ep=%d): %d parameters", path,
             src.lay.tp, src.lay.pp, src.lay.ep, model.num_parameters())
    return model


def _hf_to_mcore(hf: dict, hf_cfg: dict, cfg: TransformerConfig, source: str) -> dict:
    """HF tensors -> GPTModel keys through the converter's per-layer layouts (one mapping for
    loading and converting: ``layouts.hf_layer_to_full`` fuses QKV per query group, ``[gate;
    up]``, and routes MoE experts)."""
    where = os.path.join(source, "config.json")
    spec = L.spec_of_config(family_for_hf(hf_cfg, where), cfg, hf_cfg, where)
    used = set()

    def get(name: str) -> np.ndarray:
        if name not in hf:
            raise KeyError(f"{source}: missing tensor {name!r}")
        used.add(name)
        return hf[name]

    out = {"embedding.word_embeddings.weight": get("model.embed_tokens.weight"),
           "decoder.final_layernorm.weight": get("model.norm.weight")}
    if cfg.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = get("lm_head.weight")
    elif "lm_head.weight" in hf:
        used.add("lm_head.weight")
    for i in range(spec.num_layers):
        full = L.hf_layer_to_full(spec, get, i)
        if cfg.moe_grouped_gemm and spec.is_moe(i):
            full = experts_to_grouped(full, spec.num_experts)
        out.update({f"decoder.layers.{i}.{k}": v for k, v in full.items()})
    spec.mtp_layers = MTP.present_depths(
        spec, lambda j: MTP.hf_marker(spec, j) in hf, source)
    depths = mtp_depths(spec, cfg, source)
    for j in range(depths):
        out.update(mtp_state(MTP.mtp_hf_to_full(spec, get, j, L.hf_layer_to_full, source),
                             j, cfg, spec))
    mtp = sorted(k for k in hf if MTP.is_mtp_tensor(spec, k) and k not in used)
    if mtp:
        log.warning("%s: skipped %d tensors of MTP depths %d.. (model.mtp_num_layers is %d)",
                    source, len(mtp), depths, depths)
    leftover = sorted(set(hf) - used - set(mtp)
                      - {k for k in hf if k.endswith("rotary_emb.inv_freq")})
    if leftover:
        raise KeyError(f"{source}: unexpected tensors {leftover[:5]} for this architecture")
    return out


def mtp_depths(spec, cfg: TransformerConfig, source: str) -> int:
    """How many of the folder's MTP depths the model takes (``model.mtp_num_layers``; fewer
    is allowed, the rest are skipped)."""
    want = cfg.mtp_num_layers or 0
    if want > spec.mtp_layers:
        raise ValueError(f"{source}: model.mtp_num_layers ({want}) exceeds the "
                         f"{spec.mtp_layers} MTP layer(s) of the checkpoint")
    return want


def mtp_state(full: dict, j: int, cfg: TransformerConfig, spec) -> dict:
    """Full MTP depth ``j`` (keys relative to ``mtp.layers.{j}.``) -> GPTModel keys, experts
    grouped when the model groups them."""
    pre = "transformer_layer."
    inner = {k[len(pre):]: v for k, v in full.items() if k.startswith(pre)}
    if cfg.moe_grouped_gemm and spec.is_moe(spec.num_layers + j):
        inner = experts_to_grouped(inner, spec.num_experts)
    out = {f"mtp.layers.{j}.{k}": v for k, v in full.items() if not k.startswith(pre)}
    out.update({f"mtp.layers.{j}.{pre}{k}": v for k, v in inner.items()})
    return out


def experts_to_grouped(full: dict, num_experts: int) -> dict:
    """Per-expert ``local_experts.{e}.linear_fc1/2`` -> Megatron's ``GroupedMLP`` tensors:
    ``weight1`` = ``stack_e(fc1_e.T)`` ``[E, H, 2F]`` stored ``[H, E*2F]``, ``weight2`` =
    ``stack_e(fc2_e.T)`` ``[E, F, H]`` stored ``[E*F, H]`` (same memory, Megatron's views)."""
    out = {k: v for k, v in full.items() if not k.startswith("mlp.experts.local_experts.")}
    pre = "mlp.experts.local_experts."
    w1 = np.stack([full[f"{pre}{e}.linear_fc1.weight"].T for e in range(num_experts)])
    w2 = np.stack([full[f"{pre}{e}.linear_fc2.weight"].T for e in range(num_experts)])
    out["mlp.experts.weight1"] = np.ascontiguousarray(w1).reshape(w1.shape[1], -1)
    out["mlp.experts.weight2"] = np.ascontiguousarray(w2).reshape(-1, w2.shape[2])
    return out
