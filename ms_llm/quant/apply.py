"""``apply_quantization(model, quant_cfg)``: swap the modules the ``quant:`` section selects for
their MXFP8 versions. Call it right after building the model and before anything wraps or shards
it (FSDP, tensor parallel, ``mindspore.jit``), so those see the new modules.

Selection (HyperParallel's rules): candidates are modules of exactly a registered type
(``compat.nn.Linear`` and ``ms_llm.ops.Linear`` -> ``MXFP8Linear``; parallel linears and MoE
experts register themselves with ``register_replacement``). Exact types, not subclasses: a
subclass may add communication or change semantics that a plain MXFP8Linear would drop.
``apply_modules`` / ``ignored_modules`` are ``fnmatch`` globs over module names (``*`` crosses
dots). Defaults: every candidate under ``decoder.layers.``, never the output layer nor an MoE
router. A pattern matching no candidate or an empty selection is an error naming it.

A selected module whose dims are not multiples of MXFP8's 32-element block (MLA's small
down-projections, a tensor-parallel shard of a 32-row projection) is, as torchao's MX recipe
does, kept in the model's precision and listed in one line (``quant.mx_unaligned: keep``, the
default; ``error``: a one-line error naming it). A shard's dims are known when tensor parallel
cuts the module: the MXFP8 module then runs its source module's matmul and says so
(``kept_unaligned``).
"""
from __future__ import annotations

import fnmatch
import logging
from typing import Callable, Dict, List, Sequence

from mindspore import nn as ms_nn

from ms_llm.compat import nn
from ms_llm.models.moe import GroupedMLP
from ms_llm.ops.linear import Linear as OpsLinear
from .modules import MXFP8GroupedMLP, MXFP8Linear, UnalignedDims
from .mx import check_scale_mode, elem_format
from ._dispatch import resolve_mx_path

log = logging.getLogger("ms_llm.quant")
RECIPES = ("mxfp8",)
DEFAULT_APPLY = ("decoder.layers.*",)
ALWAYS_IGNORED = ("output_layer", "*.router", "*.router.*")
# The model's linears are ms_llm.ops.Linear (compat.nn.Linear on the fast matmul path).
_REPLACEMENTS: Dict[type, Callable] = {nn.Linear: MXFP8Linear.from_float,
                                       OpsLinear: MXFP8Linear.from_float,
                                       GroupedMLP: MXFP8GroupedMLP.from_float}


def register_replacement(cls: type, factory: Callable) -> None:
    """Make modules of exactly ``cls`` candidates; ``factory(module, scale_mode=, elem_dtype=,
    name=)`` builds the MXFP8 module reusing ``module``'s Parameters."""
    _REPLACEMENTS[cls] = factory


def _match(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def apply_quantization(model: ms_nn.Cell, quant_cfg) -> List[str]:
    """Replace the selected modules in place; returns their names (empty when ``recipe`` is
    unset). ``quant_cfg`` is ``RunConfig.quant`` (recipe, scale_mode, apply_modules,
    ignored_modules; optional elem_dtype, default float8_e4m3fn)."""
    recipe = getattr(quant_cfg, "recipe", None)
    if recipe is None:
        return []
    if recipe not in RECIPES:
        raise ValueError(f"quant.recipe: unknown recipe {recipe!r} (expected one of {RECIPES})")
    try:
        scale_mode = check_scale_mode(quant_cfg.scale_mode)
        elem = elem_format(getattr(quant_cfg, "elem_dtype", None) or "float8_e4m3fn").name
    except ValueError as e:
        raise ValueError(f"quant.{e}") from None
    apply = list(quant_cfg.apply_modules or DEFAULT_APPLY)
    ignored = list(quant_cfg.ignored_modules or [])

    candidates = [(n, c) for n, c in model.cells_and_names() if n and type(c) in _REPLACEMENTS]
    names = [n for n, _ in candidates]
    example = f" (candidates look like '{names[0]}')" if names else " (the model has none)"
    for key, patterns in (("apply_modules", apply), ("ignored_modules", ignored)):
        for p in patterns:
            if not any(fnmatch.fnmatchcase(n, p) for n in names):
                raise ValueError(f"quant.{key}: pattern {p!r} matches no replaceable module"
                                 f"{example}")
    selected = [(n, c) for n, c in candidates
                if _match(n, apply) and not _match(n, ignored) and not _match(n, ALWAYS_IGNORED)]
    if not selected:
        raise ValueError(f"quant: apply_modules {apply} minus ignored_modules {ignored} selects "
                         f"no module")
    keep = getattr(quant_cfg, "mx_unaligned", "keep") == "keep"
    path = resolve_mx_path()
    # Build every replacement first (dims are checked here), then swap: an error leaves the
    # model untouched rather than half-converted.
    built, kept = [], []
    record = KeptModules(kept)
    for n, c in selected:
        try:
            new = _REPLACEMENTS[type(c)](c, scale_mode=scale_mode, elem_dtype=elem, name=n)
        except UnalignedDims as e:
            if not keep:
                raise ValueError(f"{e}, or set quant.mx_unaligned: keep") from None
            kept.append(n)
            continue
        if keep and hasattr(new, "plain_matmul"):     # a tensor-parallel shard may not align
            new.plain_matmul = getattr(c, "local_matmul", None)
            new.kept = record
        built.append((n, new))
    if not built:
        raise ValueError(f"quant: every selected module has dims that are not multiples of 32 "
                         f"(kept in high precision: {', '.join(kept)})")
    for n, new in built:
        nn.set_submodule(model, n, new)
    log.info("quant: %s (%s, scale_mode=%s, %s path) replaced %d modules: %s", recipe, elem,
             scale_mode, path, len(built), ", ".join(n for n, _ in built))
    model.mx_unaligned = record
    return [n for n, _ in built]


class KeptModules:
    """The selected modules left in high precision because a dim is not a multiple of 32:
    whole modules (at replacement) and tensor-parallel shards (added when tensor parallel cuts
    them)."""

    def __init__(self, names: List[str]):
        self.names = names


def kept_unaligned(model: ms_nn.Cell) -> List[str]:
    """``KeptModules.names`` of a quantized model (empty when nothing was kept)."""
    record = getattr(model, "mx_unaligned", None)
    return list(record.names) if record is not None else []
