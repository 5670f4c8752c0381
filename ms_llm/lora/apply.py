"""``apply_lora(model, lora_cfg, seed)``: put adapters on the linears the ``lora:`` section
selects and freeze everything else. A module conversion like ``apply_quantization``: it runs
in ``parallelize_model`` after MXFP8 (an MXFP8 base keeps its recipe; the adapter runs in fp32)
and before tensor parallel and FSDP, which shard the adapters like their base weights.

Selection: candidates are the decoder's ``linear_qkv``, ``linear_proj``, ``linear_fc1`` and
``linear_fc2`` (and Gated DeltaNet's ``in_proj_qkvz``, ``in_proj_ba``, ``out_proj``; latent
attention's ``linear_q_proj`` / ``linear_q_down_proj`` / ``linear_q_up_proj`` /
``linear_kv_down_proj`` / ``linear_kv_up_proj``). A target without dots or glob characters names
the last component (``linear_qkv``; on latent attention, as in MindSpeed-LLM's DeepSeek scripts,
it names the down-projections MindSpeed fuses under that name: ``base.ALIASES``); anything
else is an ``fnmatch`` glob over the full module name (``*`` crosses dots), e.g.
``decoder.layers.*.self_attention.linear_qkv``. MoE: attention and dense-MLP layers get
adapters; routed and shared experts do not (the bare names skip them; a glob that selects only
expert linears is refused as not built). A target matching nothing is an error.

Every Parameter that was trainable becomes a frozen base weight (``requires_grad`` False, no
optimizer state, not in training checkpoints); buffers (the routers' ``expert_bias``) stay as
they were.
"""
from __future__ import annotations

import fnmatch
import logging
import zlib
from typing import List, Sequence, Tuple

import numpy as np
from mindspore import nn as ms_nn

from ms_llm.compat import nn
from .base import ALIASES, TARGETS
from .modules import LoRALinear, is_frozen_base, mark_frozen_base

log = logging.getLogger("ms_llm.lora")
_EXPERT_PARTS = (".mlp.experts.", ".mlp.shared_experts.")


def _matches(name: str, pattern: str) -> bool:
    if "." not in pattern and not any(ch in pattern for ch in "*?["):
        last = name.rsplit(".", 1)[-1]
        return last == pattern or last in ALIASES.get(pattern, ())
    return fnmatch.fnmatchcase(name, pattern)


def select_targets(model: ms_nn.Cell, patterns: Sequence[str]) -> List[Tuple[str, ms_nn.Cell]]:
    """The (name, module) pairs the ``lora.target_modules`` patterns select, in model order."""
    linears = [(n, c) for n, c in model.cells_and_names()
               if n and n.rsplit(".", 1)[-1] in TARGETS]
    experts = [n for n, _ in linears if any(p in n for p in _EXPERT_PARTS)]
    candidates = [(n, c) for n, c in linears if n not in experts]
    for p in patterns:
        if any(_matches(n, p) for n, _ in candidates):
            continue
        if any(_matches(n, p) for n in experts):
            if "." in p or any(ch in p for ch in "*?["):
                raise ValueError(f"lora.target_modules: {p!r} selects only MoE expert linears; "
                                 f"LoRA on routed/shared experts is not built yet")
            continue
        example = f" (candidates look like '{candidates[0][0]}')" if candidates else ""
        raise ValueError(f"lora.target_modules: {p!r} matches no {' / '.join(TARGETS)} "
                         f"module{example}")
    return [(n, c) for n, c in candidates if any(_matches(n, p) for p in patterns)]


def count_parameters(model: ms_nn.Cell) -> Tuple[int, int]:
    """(trainable, all) over the distinct Parameters of ``model``."""
    seen, trainable, total = set(), 0, 0
    for _, p in model.parameters_and_names():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = int(np.prod(p.shape))
        total += n
        trainable += n if p.requires_grad else 0
    return trainable, total


def trainable_report(model: ms_nn.Cell) -> str:
    """PEFT's ``print_trainable_parameters`` line."""
    trainable, total = count_parameters(model)
    return (f"trainable params: {trainable:,} || all params: {total:,} || "
            f"trainable%: {100.0 * trainable / max(total, 1):.4f}")


def apply_lora(model: ms_nn.Cell, lora_cfg, seed: int = 0) -> List[str]:
    """Replace the selected linears by ``LoRALinear`` (reusing their Parameters) and freeze the
    base; returns the adapted module names (empty when ``lora_cfg.r`` is 0). Adapter A is drawn
    from a generator seeded by ``seed`` and the module name, so every rank draws the same A."""
    r = int(getattr(lora_cfg, "r", 0) or 0)
    if r == 0:
        return []
    selected = select_targets(model, list(lora_cfg.target_modules))
    if not selected:
        raise ValueError(f"lora.target_modules {list(lora_cfg.target_modules)} selects no module "
                         f"(lora.r {r} > 0 would train nothing)")
    built = []
    for name, module in selected:
        if r > min(module.in_features, module.out_features):
            raise ValueError(f"lora.r ({r}) exceeds {name}'s smaller dimension "
                             f"({min(module.in_features, module.out_features)})")
        rng = np.random.default_rng([int(seed), zlib.crc32(name.encode())])
        built.append((name, LoRALinear(module, r, float(lora_cfg.alpha),
                                       float(lora_cfg.dropout), rng)))
    adapters = {id(m.lora_A.weight) for _, m in built} | {id(m.lora_B.weight) for _, m in built}
    for _, p in model.parameters_and_names():
        if p.requires_grad and id(p) not in adapters:
            mark_frozen_base(p)
    for name, new in built:
        nn.set_submodule(model, name, new)
        # unique Parameter names (a compiled graph refuses two 'lora_A.weight')
        new.lora_A.weight.name = f"{name}.lora_A.weight"
        new.lora_B.weight.name = f"{name}.lora_B.weight"
    log.info("lora: r=%d alpha=%s on %d modules", r, lora_cfg.alpha, len(built))
    return [n for n, _ in built]


def buffer_names(model: ms_nn.Cell) -> frozenset:
    """Non-trainable Parameters that are not frozen base weights (the routers' expert_bias)."""
    return frozenset(n for n, p in model.parameters_and_names()
                     if not p.requires_grad and not is_frozen_base(p))


def mark_frozen_shards(model: ms_nn.Cell, buffers: frozenset) -> None:
    """Tensor parallel replaces the Parameters it shards (embedding, head, linears) by new
    ones; those of frozen base weights are frozen base weights too (names do not change)."""
    for n, p in model.parameters_and_names():
        if not p.requires_grad and n not in buffers:
            mark_frozen_base(p)
