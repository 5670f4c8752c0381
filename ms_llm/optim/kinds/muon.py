"""Muon (``training.optimizer: muon``, Megatron's ``--optimizer muon`` / ``dist_muon``):
Newton-Schulz-orthogonalised momentum on the hidden matrices, AdamW on the rest
(``ms_llm.optim.muon``); one fp32 momentum buffer per matrix element, AdamW's two moments
elsewhere. Its keys are Megatron-Core's ``muon_*`` options."""
from __future__ import annotations

import functools
from typing import Optional

from ms_llm.validation import at_least, greater_than, one_of, within
from ..param_groups import is_muon_matrix, matrices_rule
from .adamw import ADAMW, adam_options
from .registry import OptimizerKind, register_optimizer

NAME = "muon"


def _build(cfg, groups, pstate, model_config):
    from ..adamw import AdamW
    from ..muon import Muon
    t = cfg.training
    adam = functools.partial(AdamW, **adam_options(t))
    return functools.partial(
        Muon, lr=t.lr, momentum=t.muon_momentum, nesterov=t.muon_nesterov,
        weight_decay=t.weight_decay, coefficient_type=t.muon_coefficient_type,
        num_ns_steps=t.muon_num_ns_steps, scale_mode=t.muon_scale_mode,
        extra_scale_factor=t.muon_extra_scale_factor, split_qkv=t.muon_split_qkv,
        tp_mode=t.muon_tp_mode, fp32_matmul_prec=t.muon_fp32_matmul_prec,
        model_config=model_config, groups=groups, adam=adam, pstate=pstate)


def _check_shards(named_params, groups, pstate) -> None:
    from ..muon_owners import refuse_empty_shards
    refuse_empty_shards(named_params, groups, pstate)


def _megatron_note(keys) -> Optional[str]:
    if "training.muon_fp32_matmul_prec" in keys:
        return None
    return ("--muon-fp32-matmul-prec: Megatron's default is medium (bf16 GEMM operands); "
            "ms-llm keeps fp32 Newton-Schulz (highest) unless it is given")


MUON = register_optimizer(OptimizerKind(
    name=NAME, title="Muon", build=_build,
    state_elements=lambda name, shape: 1 if is_muon_matrix(name, len(shape)) else 2,
    param_rule=matrices_rule(NAME, ADAMW.name),    # its matrices, AdamW the rest
    value_rules={
        "training.muon_momentum": within(0, 1, hi_open=True),
        "training.muon_coefficient_type": one_of("simple", "quintic", "polar_express", "cans",
                                                 "aol"),
        "training.muon_num_ns_steps": at_least(1),
        "training.muon_scale_mode": one_of("spectral", "shape_scaling", "unit_rms_norm"),
        "training.muon_extra_scale_factor": greater_than(0),
        "training.muon_tp_mode": one_of("blockwise", "duplicated", "distributed"),
        "training.muon_fp32_matmul_prec": one_of("highest", "medium")},
    check_shards=_check_shards,
    megatron_names={NAME: {}, "dist_muon": {"parallel.use_distributed_optimizer": True}},
    megatron_note=_megatron_note))
