"""Megatron-Core model (and optimizer-state) keys in a ``torch_dist`` checkpoint <-> the
per-layer Megatron names ms-llm's GPTModel uses.

In ``torch_dist`` Megatron-Core stores every decoder-layer tensor once, stacked over the layers
(``decoder.layers.self_attention.linear_qkv.weight`` of shape ``[num_layers, ...]``, layer i at
offset i of dim 0, whatever the pipeline split), under the TransformerEngine names even for the
local spec (the layer's input norm is ``linear_qkv.layer_norm_weight``, the pre-MLP norm
``linear_fc1.layer_norm_weight``). The SwiGLU ``linear_fc1`` is ``[gate; up]`` over the whole FFN
(tensor-parallel ranks write their gate and up rows as separate chunks of it), which is the
tp=1 tensor itself. Optimizer moments use the model keys behind ``optimizer.state.<name>.``.
"""
from __future__ import annotations

import re
from typing import Dict, Iterable, Optional

import numpy as np

from .io import TorchDistReader, TorchDistWriter

LAYERS = "decoder.layers."
_TE_NAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
             "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}
_LOCAL_NAMES = {v: k for k, v in _TE_NAMES.items()}
_PREFIX = re.compile(r"^((?:optimizer\.state\.[a-z_0-9]+\.)?)(.*)$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def read_state(reader: TorchDistReader, prefixes: Iterable[str] = ("",)) -> Dict[str, np.ndarray]:
    """``{per-layer key: array}`` of every tensor under ``prefixes`` (``""``: the model;
    ``"optimizer.state.exp_avg."`` ...), ``_extra_state`` and other objects left out."""
    out: Dict[str, np.ndarray] = {}
    for key in reader.tensors:
        prefix, name = _PREFIX.match(key).groups()
        if prefix not in prefixes:
            continue
        if not name.startswith(LAYERS):
            out[prefix + name] = reader.tensor(key)
            continue
        rest = name[len(LAYERS):]
        rest = _TE_NAMES.get(rest, rest)
        stacked = reader.tensor(key)
        for i in range(stacked.shape[0]):
            out[f"{prefix}{LAYERS}{i}.{rest}"] = stacked[i]
    return out


def write_state(writer: TorchDistWriter, state: Dict[str, np.ndarray]) -> None:
    """Write per-layer keys the way Megatron-Core saves them: layers stacked under the TE
    names, one chunk per layer (a loader at any layout reads the rows it needs)."""
    stacks: Dict[str, Dict[int, np.ndarray]] = {}
    for key, value in state.items():
        prefix, name = _PREFIX.match(key).groups()
        m = _LAYER.match(name)
        if m is None:
            writer.add(key, value.shape, (0,) * value.ndim, value)
            continue
        rest = _LOCAL_NAMES.get(m.group(2), m.group(2))
        stacks.setdefault(f"{prefix}{LAYERS}{rest}", {})[int(m.group(1))] = value
    for key, layers in stacks.items():
        n = len(layers)
        if sorted(layers) != list(range(n)):
            raise ValueError(f"{key}: layers {sorted(layers)} are not 0..{n - 1}")
        shape = layers[0].shape
        for i in range(n):
            if layers[i].shape != shape:
                raise ValueError(f"{key}: layer {i} has shape {layers[i].shape}, layer 0 {shape}")
            writer.add(key, (n, *shape), (i,) + (0,) * len(shape), layers[i][None])


# ----------------------------------------------------------------------------- training state
MOMENTS = ("exp_avg", "exp_avg_sq")


def read_training_state(reader: TorchDistReader) -> dict:
    """A Megatron-Core training checkpoint (model, Adam moments under
    ``optimizer.state.<moment>.<model key>``, the shared ``common_step``, iteration and the
    ``opt_param_scheduler`` entry) as ``{"model": {...}, "optimizer": {"step": n,
    "exp_avg.<name>": ..., "exp_avg_sq.<name>": ...}, "iteration": i, "opt_param_scheduler":
    {...} or None}`` -- the optimizer part in ms-llm's AdamW ``state_dict`` names."""
    state = read_state(reader, ("", *(f"optimizer.state.{m}." for m in MOMENTS)))
    model = {k: v for k, v in state.items() if not k.startswith("optimizer.")}
    optim: Dict[str, object] = {k[len("optimizer.state."):]: v for k, v in state.items()
                                if k.startswith("optimizer.")}
    common = reader.common
    opt_common = common.get("optimizer") or {}
    step = (opt_common.get("state") or {}).get("common_step")
    if step is not None:
        # stored as shape [] or [1]
        optim["step"] = np.array(int(np.asarray(step).reshape(-1)[0]), np.int64)
    return {"model": model, "optimizer": optim, "iteration": common.get("iteration"),
            "opt_param_scheduler": common.get("opt_param_scheduler")}


def write_training_state(writer: TorchDistWriter, model: Dict[str, np.ndarray],
                         optimizer: Dict[str, np.ndarray], iteration: int,
                         scheduler: Optional[dict] = None, lr: float = 0.0,
                         betas=(0.9, 0.999), eps: float = 1e-8,
                         weight_decay: float = 0.0,
                         extra_common: Optional[dict] = None,
                         distributed: bool = False) -> None:
    """The inverse of ``read_training_state``: the moments under Megatron-Core's keys, the step
    as its ``common_step``, and one torch AdamW param group, so megatron-core's loader restores
    them (``FP32Optimizer`` layout: fp32 parameters, moments shaped like them).
    ``distributed``: the ``DistributedOptimizer``'s ``fully_reshardable`` layout instead
    (``distributed_common``), which megatron-core's distributed optimizer
    loads and the non-distributed layout is not (it lacks the fp32 ``param`` copies)."""
    state = dict(model)
    if distributed:
        state.update({f"optimizer.state.param.{k}": np.asarray(v, np.float32)
                      for k, v in model.items()})
    for m in MOMENTS:
        for name in model:
            key = f"{m}.{name}"
            if key not in optimizer:
                raise KeyError(f"optimizer state: missing {key!r}")
            state[f"optimizer.state.{key}"] = np.asarray(optimizer[key], np.float32)
    write_state(writer, state)
    common = {"iteration": int(iteration),
              "optimizer": {"state": {"common_step": np.array(float(optimizer["step"]),
                                                              np.float32)},
                            "param_groups": [{"lr": lr, "betas": tuple(betas), "eps": eps,
                                              "weight_decay": weight_decay, "amsgrad": False,
                                              "maximize": False, "foreach": None,
                                              "capturable": False, "differentiable": False,
                                              "fused": None, "decoupled_weight_decay": True}]}}
    # (no "params" ids: megatron-core keeps them out of the checkpoint, the loader's own stay)
    if distributed:
        common.update(distributed_common(int(np.asarray(optimizer["step"]).reshape(-1)[0]),
                                         lr=lr, betas=betas, eps=eps,
                                         weight_decay=weight_decay))
    if scheduler is not None:
        common["opt_param_scheduler"] = scheduler
    common.update(extra_common or {})   # e.g. Megatron-LM's ``args`` (consumed samples)
    writer.close(common)


def distributed_common(step: int, *, lr: float, betas, eps: float, weight_decay: float,
                       min_lr: float = 0.0) -> dict:
    """``common.pt`` entries of a ``fully_reshardable`` save: the DistributedOptimizer's
    ``state_dict`` (megatron-core's two default param groups, matched on load by
    ``wd_mult`` / ``lr_mult`` / ``is_expert_parallel`` / ``is_decoupled_lr``, each with Adam's
    step) and the ``content_metadata`` naming the layout."""
    groups = [{"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
               "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
               "differentiable": False, "fused": None, "decoupled_weight_decay": True,
               "is_expert_parallel": False, "default_config": True, "wd_mult": wd,
               "lr_mult": 1.0, "is_decoupled_lr": False, "max_lr": lr, "min_lr": min_lr,
               "step": float(step)} for wd in (1.0, 0.0)]
    return {"optimizer": {"optimizer": {"param_groups": groups},
                          "param_state_sharding_type": "fully_reshardable"},
            "content_metadata": {"distrib_optim_sharding_type": "fully_reshardable",
                                 "distrib_optim_fully_reshardable_mem_efficient": False,
                                 "singleton_local_shards": False,
                                 "chained_optim_avoid_prefix": True}}
