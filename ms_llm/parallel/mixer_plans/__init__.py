"""How each token-mixer kind (``ms_llm.models.mixers``) is parallelized: one ``MixerPlan`` per
kind, registered by a module of this package (imported on first lookup).

The model stays parallelism-free; ``apply_tensor_parallel``, ``apply_context_parallel`` and
``describe_layouts`` ask a layer's kind for its plan instead of testing its class or name:

* ``tensor_parallel(mixer, tp)``: shard the mixer in place (``tp``: a
  ``tensor_parallel.TensorParallelContext`` with the group and the column / row / shard /
  mark-partial builders);
* ``validate_tp(config, size)``: one-line ``ValueError`` when the config cannot split ``size``
  ways (before any module is built);
* ``context_parallel(mixer, cp)``: swap in its sequence-split form (``cp``: the run's
  ``ContextParallel``);
* ``describe(mixer)``: record non-plain storage layouts of its tensors (checkpoint regions).
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable, Dict

__all__ = ["MixerPlan", "register_plan", "unregister_plan", "plan_for"]


def _nothing(*args) -> None:
    return None


@dataclass(frozen=True)
class MixerPlan:
    tensor_parallel: Callable[[Any, Any], None]
    context_parallel: Callable[[Any, Any], None]
    validate_tp: Callable[[Any, int], None] = _nothing
    describe: Callable[[Any], None] = _nothing


_PLANS: Dict[str, MixerPlan] = {}
_loaded = False


def register_plan(kind: str, plan: MixerPlan) -> MixerPlan:
    """The parallel plan of the mixer kind named ``kind`` (one per kind)."""
    if kind in _PLANS and _PLANS[kind] is not plan:
        raise ValueError(f"register_plan: mixer kind {kind!r} already has a parallel plan")
    _PLANS[kind] = plan
    return plan


def unregister_plan(kind: str) -> MixerPlan:
    """Remove a kind's plan (tests, or a plugin replacing a built-in plan)."""
    return _PLANS.pop(kind)


def plan_for(kind) -> MixerPlan:
    """The plan of a ``MixerKind`` (or its name); one line when the kind has none."""
    global _loaded
    if not _loaded:
        _loaded = True
        for mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
            importlib.import_module(f"{__name__}.{mod}")
    name = getattr(kind, "name", kind)
    if name not in _PLANS:
        raise ValueError(f"token mixer {name!r} has no parallel plan (register one in "
                         f"ms_llm.parallel.mixer_plans)")
    return _PLANS[name]
