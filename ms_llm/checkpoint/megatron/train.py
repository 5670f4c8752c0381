"""Megatron-LM's legacy ``torch`` training checkpoints (``--ckpt-format torch``) <-> ms-llm's own:
``iter_N/mp_rank_00/model_optim_rng.pt`` holding ``args``, ``iteration``, ``model``, the
non-distributed optimizer's ``optimizer`` entry, ``opt_param_scheduler``.

The optimizer entry is torch's AdamW ``state_dict`` (under ``optimizer`` with the bf16 wrapper,
whose ``fp32_from_fp16_params`` are the weights read): moments keyed by integer ids counted over
Megatron's param groups, so reading and writing need Megatron's order -- Megatron-Core
``_get_param_groups`` (0.16): the weight-decayed group first, then the no-decay group (biases
and 1-D tensors), each in the GPTModel's ``named_parameters`` order.

Layouts: a legacy folder is fixed to the tensor / pipeline sizes that wrote it (one
``mp_rank_TT[_PPP]`` file per rank, each holding its shards and their moments); dp is free
without the distributed optimizer (every dp rank's state is the same). Reading merges any tp /
pp (the converter's merge rules, applied to the moments as to the weights) and the import is
then resharded to any layout by ms-llm's load; writing is one file (tp = pp = 1), which Megatron
resumes at tp = pp = 1 only. ``distrib_optim.pt`` beside a rank file (the distributed
optimizer) is read for resume by ``distopt`` (not written). Refused with one line:
expert parallel, virtual pipeline stages, MoE.
"""
from __future__ import annotations

import argparse
import os
import re
from typing import Dict, List, Optional, Tuple

import numpy as np

from .. import torch_pickle
from ..native.format import TRACKER
from .distopt import DISTRIB, read_distrib_optim
from ..torch_dist.model import MOMENTS
from ..torch_dist.train import read_training_dcp, staged_iter, write_tracker, \
    write_training_dcp
from ..torch_pickle.reader import load as load_torch_file

FILE = "model_optim_rng.pt"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_IN_LAYER = ("input_layernorm.weight", "self_attention.linear_proj.weight",
             "self_attention.linear_proj.bias", "self_attention.linear_qkv.weight",
             "self_attention.linear_qkv.bias", "self_attention.q_layernorm.weight",
             "self_attention.k_layernorm.weight", "pre_mlp_layernorm.weight",
             "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight",
             "mlp.linear_fc2.bias")
_TOP = ("embedding.word_embeddings.weight", None, "decoder.final_layernorm.weight",
        "output_layer.weight")


def _order_key(name: str, where: str):
    m = _LAYER.match(name)
    if m is not None and m.group(2) in _IN_LAYER:
        return (1, int(m.group(1)), _IN_LAYER.index(m.group(2)))
    if name in _TOP:
        return (_TOP.index(name), 0, 0)
    raise ValueError(f"{where}: {name}: no place in Megatron's legacy optimizer order (dense "
                     f"GPT models only)")


def param_groups(shapes: Dict[str, tuple], where: str) -> List[List[str]]:
    """Megatron-Core's param groups of a dense GPTModel: ``[decayed, not decayed]`` names."""
    names = sorted(shapes, key=lambda n: _order_key(n, where))
    no_wd = [n for n in names if len(shapes[n]) == 1 or n.endswith(".bias")]
    return [[n for n in names if n not in no_wd], no_wd]


def latest_legacy(folder: str) -> Optional[Tuple[str, int]]:
    """``(iter folder, iteration)`` named by ``folder``'s tracker when it holds a legacy
    training checkpoint (an ``optimizer`` entry); None otherwise (e.g. converted weights)."""
    tracker = os.path.join(folder, TRACKER)
    if not os.path.isfile(tracker):
        return None
    text = open(tracker, encoding="utf-8").read().strip()
    path = os.path.join(folder, f"iter_{int(text):07d}") if text.isdigit() else None
    if path is None or not os.path.isdir(path):
        return None
    return None if latest_legacy_training(path) is None else (path, int(text))


def latest_legacy_training(path: str) -> Optional[str]:
    """``path`` when its first rank file holds an ``optimizer`` entry (a training state), else
    None (converted weights). A file the reader refuses raises ``TorchFormatError``."""
    files = [os.path.join(path, d, FILE) for d in sorted(os.listdir(path))
             if d.startswith("mp_rank_") and os.path.isfile(os.path.join(path, d, FILE))]
    if not files:
        return None
    ckpt = load_torch_file(files[0], lazy=True)
    try:
        has_optim = isinstance(ckpt.obj, dict) and ckpt.obj.get("optimizer") is not None
    finally:
        ckpt.close()
    return path if has_optim else None


def _arr(v) -> np.ndarray:
    return np.asarray(v.numpy() if hasattr(v, "numpy") else v, np.float32)


def _rank_state(sd: dict, where: str) -> Tuple[Dict[str, np.ndarray], Dict[str, dict], object]:
    """One rank file's ``(weights, {moment: {name: array}}, step)``: its optimizer ids put back
    on its parameters through Megatron's param-group order of the names it holds."""
    model = {k: v for k, v in sd["model"].items()
             if not k.endswith("_extra_state") and v is not None}
    opt = sd.get("optimizer")
    if not opt:
        raise ValueError(f"{where}: holds no optimizer entry: a weights-only checkpoint, not a "
                         f"training state to resume")
    folder = os.path.dirname(os.path.abspath(where))
    if os.path.isfile(os.path.join(folder, DISTRIB)):   # --use-distributed-optimizer
        return read_distrib_optim(folder, {k: _arr(v) for k, v in model.items()},
                                  sd.get("args"), opt)
    inner = opt.get("optimizer", opt) if "fp32_from_fp16_params" in opt else opt
    groups = param_groups({k: tuple(v.shape) for k, v in model.items()}, where)
    if len(inner["param_groups"]) != len(groups) or any(
            len(g["params"]) != len(want) for g, want in zip(inner["param_groups"], groups)):
        raise ValueError(f"{where}: optimizer param groups of sizes "
                         f"{[len(g['params']) for g in inner['param_groups']]}, Megatron's "
                         f"order gives {[len(g) for g in groups]} for this model")
    weights = {k: _arr(v) for k, v in model.items()}
    moments: Dict[str, dict] = {m: {} for m in MOMENTS}
    step = None
    for gi, (g, names) in enumerate(zip(inner["param_groups"], groups)):
        for j, (pid, name) in enumerate(zip(g["params"], names)):
            st = inner["state"].get(pid)
            if st is None:
                raise ValueError(f"{where}: no optimizer state for param {pid} ({name})")
            for m in MOMENTS:
                moments[m][name] = _arr(st[m])
            step = _arr(st["step"])
            if "fp32_from_fp16_params" in opt:   # bf16: the fp32 main params are the weights
                weights[name] = _arr(opt["fp32_from_fp16_params"][gi][j])
    return weights, moments, step


def _rank_files(path: str) -> List[str]:
    ranks = sorted(d for d in os.listdir(path) if d.startswith("mp_rank_"))
    return [os.path.join(path, d, FILE) for d in ranks]


def _merged(path: str, model_type_hf: Optional[str]):
    """Several ``mp_rank_*`` files (tp / pp > 1): each rank's weights and moments, merged into
    whole tensors by the converter's own tp / pp rules (moments shard like their weights)."""
    from ..convert import MegatronSource
    folder = os.path.dirname(os.path.abspath(path))
    tracker = os.path.join(folder, TRACKER)
    named = open(tracker, encoding="utf-8").read().strip() if os.path.isfile(tracker) else ""
    if not named.isdigit() or f"iter_{int(named):07d}" != os.path.basename(path):
        raise ValueError(f"{path}: a tp / pp > 1 legacy checkpoint is read through its folder's "
                         f"{TRACKER}, which names another iteration ({named!r})")
    src = MegatronSource(folder, model_type_hf)
    try:
        r = src.reader
        if r.ep > 1 or any(len(c) > 1 for c in r.models.values()):
            raise ValueError(f"{path}: legacy training checkpoints with expert parallel or "
                             f"virtual pipeline stages are not built")
        ranks, step = {}, None
        for key, ck in r.files.items():
            weights, moments, step = _rank_state(ck.obj, ck.archive.path)
            ranks[key] = {"model": weights, **moments}

        def whole(kind: str) -> Dict[str, np.ndarray]:
            for key in r.models:
                r.models[key][0] = ranks[key][kind]
            out = {"embedding.word_embeddings.weight": src.embedding(padded=True),
                   "decoder.final_layernorm.weight": src.final_norm()}
            if src.output(padded=True) is not None:
                out["output_layer.weight"] = src.output(padded=True)
            for i in range(src.spec.num_layers):
                out.update({f"decoder.layers.{i}.{k}": v for k, v in src.layer(i).items()})
            return out
        model = whole("model")
        optim = {f"{m}.{k}": v for m in MOMENTS for k, v in whole(m).items()}
    finally:
        src.close()
    return model, optim, step


def import_legacy(path: str, save_dir: str, state: dict, gated: bool,
                  global_batch_size: int, model_type_hf: Optional[str] = None
                  ) -> Tuple[str, dict]:
    """The legacy training checkpoint folder ``path`` (``iter_N``) as a one-rank ms-llm
    checkpoint in ``save_dir``: ``(its path, the state it records)``. Several rank files (tp /
    pp > 1) are merged through their ``args`` (``model_type_hf`` names the family when the
    args do not)."""
    files = _rank_files(path)
    if not files:
        raise ValueError(f"{path}: no mp_rank_*/{FILE}")
    sd = load_torch_file(files[0])
    if len(files) == 1:
        model, moments, step = _rank_state(sd, files[0])
        optim = {f"{m}.{k}": v for m, d in moments.items() for k, v in d.items()}
    else:
        model, optim, step = _merged(path, model_type_hf)
    optim["step"] = np.asarray(step)
    args = sd.get("args")
    return write_training_dcp(save_dir, model, optim, int(sd["iteration"]),
                              sd.get("opt_param_scheduler"),
                              getattr(args, "consumed_train_samples", None), state, gated,
                              global_batch_size, files[0])


def export_legacy(dcp_path: str, save_dir: str, *, lr: float, betas, eps: float,
                  weight_decay: float, global_batch_size: int,
                  megatron_args: Optional[dict] = None) -> str:
    """Rewrite the complete ms-llm checkpoint ``dcp_path`` as
    ``save_dir/iter_<step>/mp_rank_00/model_optim_rng.pt`` (torch AdamW ids in Megatron's
    order) and point the tracker at it; returns the ``iter_*`` folder."""
    model, optim, state, step = read_training_dcp(dcp_path)
    groups = param_groups({k: v.shape for k, v in model.items()}, dcp_path)
    steps = np.array(float(optim["step"]), np.float32)
    opt_state, param_groups_sd, pid = {}, [], 0
    for gi, names in enumerate(groups):
        ids = []
        for name in names:
            opt_state[pid] = {"step": steps, **{m: optim[f"{m}.{name}"] for m in MOMENTS}}
            ids.append(pid)
            pid += 1
        wd_mult = 1.0 if gi == 0 else 0.0
        param_groups_sd.append({
            "lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay * wd_mult,
            "amsgrad": False, "foreach": None, "maximize": False, "capturable": False,
            "differentiable": False, "fused": None, "decoupled_weight_decay": True,
            "is_expert_parallel": False, "default_config": True, "wd_mult": wd_mult,
            "lr_mult": 1.0, "is_decoupled_lr": False, "max_lr": lr,
            "min_lr": (megatron_args or {}).get("min_lr", 0.0), "params": ids})
    consumed = int((state.get("data") or {}).get("consumed_samples", step * global_batch_size))
    args = argparse.Namespace(**{**(megatron_args or {}), "iteration": step,
                                 "consumed_train_samples": consumed,
                                 "consumed_valid_samples": 0, "ckpt_format": "torch"})
    sd = {"args": args, "checkpoint_version": 3.0, "iteration": step, "model": model,
          "optimizer": {"state": opt_state, "param_groups": param_groups_sd}}
    if state.get("opt_param_scheduler") is not None:
        sd["opt_param_scheduler"] = state["opt_param_scheduler"]
    with staged_iter(save_dir, step) as tmp:
        os.makedirs(os.path.join(tmp, "mp_rank_00"))
        torch_pickle.save(sd, os.path.join(tmp, "mp_rank_00", FILE))
    write_tracker(save_dir, step)
    return os.path.join(save_dir, f"iter_{step:07d}")
