"""The model-family registry: one frozen ``FamilySpec`` per family, and the only place a family's
identity is written.

A family is a name a run config uses (``model.family``), the Hugging Face ``config.json`` it
reads and writes (``model_type``, architecture class, the two translations ``from_hf`` /
``to_hf``), the architecture switches it sets (``defaults``), the checkpoint layout its layers
take (``layer_kinds``: the converter's per-layer layout names) and the names the Megatron /
MindSpeed converter uses for it (``megatron_names``, ``megatron_args``). Everything else that
needs a family (``ms-llm convert``'s ``--model-type-hf``, ``from_pretrained``, ``ms-llm export``'s
family guess, ``ms-llm qualify``'s matrix, the MindSpeed ``--spec`` table, the config schema's
family list, the registry tests) derives from these records, so a new family is one folder,
``ms_llm/models/families/<name>/``: ``hf.py`` (the ``config.json`` mapping), ``spec.py`` (the
``FamilySpec``), ``layouts.py`` (its own checkpoint layer kinds, if any) and an ``__init__.py``
that registers them.

Why a registry and not a table per consumer: the same facts were written in five places, and
they disagreed (an alias known to one and not another, a sparse-layer rule computed twice).
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from .config import TransformerConfig
from .mixers import layer_mixer

__all__ = ["FamilySpec", "Qualify", "register_family", "unregister_family", "get_family",
           "family_for_hf", "family_for_config", "families", "names", "parse_hf_config",
           "BUILTIN_FAMILY_MODULES"]

# The first families ms-llm shipped, listed first; ``families()`` imports every package of
# ``ms_llm.models.families`` on first use (each family package registers itself).
BUILTIN_FAMILY_MODULES = ("llama", "qwen25", "qwen3", "qwen3_moe", "deepseek_v3", "glm45")


def _no_claim(config: TransformerConfig) -> bool:
    return False


def _no_extras(hf: Mapping, source: str) -> dict:
    return {}


def _no_args(config: TransformerConfig) -> dict:
    return {}


@dataclass(frozen=True)
class Qualify:
    """How ``ms-llm qualify`` trains the family: a row name, a YAML under ``configs/`` and the
    tiny-shape command-line keys (PyNative, micro-batch 2). ``num_layer_list``: Megatron's
    ``--num-layer-list`` of the two-stage pipeline cell when the row's layers do not split evenly
    (a 3-layer row: "1,2"); ``quick``: the row is in the ``quick`` suite."""

    name: str
    config: str
    args: Tuple[str, ...]
    num_layer_list: Optional[str] = None
    quick: bool = False


@dataclass(frozen=True, eq=False)   # identity: one record per family
class FamilySpec:
    """One model family.

    ``from_hf(config_json_dict, source)`` is the one reader of a ``config.json`` for this family
    (bad input: ``ValueError`` naming ``source`` and the key); ``to_hf(config)`` writes the
    ``config.json`` of a TransformerConfig (``ValueError`` saying what HF cannot express).
    ``claims(config)`` says whether an exported TransformerConfig with no family name belongs
    here (asked in ``claim_order``, lowest first). ``layer_kinds(config)`` names each decoder
    layer's checkpoint layout (``"attention"``: fused QKV; ``"mla"``: latent attention; a family
    with linear- and full-attention layers returns one name per layer and registers the new
    kind's layout with ``ms_llm.models.layouts.register_layer_kind``). ``layout_extras(hf,
    source)`` returns the layout facts a model config does not hold (MTP depths in the folder,
    MLA linear biases). ``tiny_hf``: a small ``config.json`` the registry tests build a random
    transformers model from (parity and conversion round trip, per family, automatically).
    ``mindspeed_specs``: the MindSpeed-LLM ``--spec`` module names (``<name>_spec``) that build
    this family; two families may share one (Qwen3 and Qwen3-MoE: ``--num-experts`` decides)."""

    name: str
    hf_model_type: str
    hf_architecture: str
    from_hf: Callable[[Mapping, str], TransformerConfig]
    to_hf: Callable[[TransformerConfig], dict]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    aliases: Tuple[str, ...] = ()
    megatron_names: Tuple[str, ...] = ()
    megatron_args: Callable[[TransformerConfig], dict] = _no_args
    mindspeed_specs: Tuple[str, ...] = ()
    claims: Callable[[TransformerConfig], bool] = _no_claim
    claim_order: int = 100
    layer_kinds: Optional[Callable[[TransformerConfig], Tuple[str, ...]]] = None
    layout_extras: Callable[[Mapping, str], dict] = _no_extras
    from_hf_for_layout: Optional[Callable[[Mapping, str], TransformerConfig]] = None
    tiny_hf: Mapping[str, Any] = field(default_factory=dict)
    qualify: Optional[Qualify] = None
    # a hybrid family: each layer's mixer kind from ``{"num_hidden_layers", "layer_types" or
    # "full_attention_interval"}`` (MindSpeed's --full-attention-interval asks it)
    hybrid_layer_types: Optional[Callable[[Mapping, str], List[str]]] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))
        object.__setattr__(self, "tiny_hf", MappingProxyType(dict(self.tiny_hf)))
        if not self.megatron_names:
            object.__setattr__(self, "megatron_names", (self.name,))

    @property
    def is_moe(self) -> bool:
        return self.defaults.get("mlp_type") == "moe"

    @property
    def convert_name(self) -> str:
        """The ``--model-type-hf`` name written when none is given (MindSpeed-LLM's)."""
        return self.megatron_names[0]

    def kinds(self, config: TransformerConfig) -> Tuple[str, ...]:
        """Checkpoint layout name of each decoder layer."""
        if self.layer_kinds is not None:
            return tuple(self.layer_kinds(config))
        return tuple(layer_mixer(config, i).layout for i in range(config.num_layers))

    def config_for_layout(self, hf: Mapping, source: str) -> TransformerConfig:
        """The architecture the weights are shaped by. Usually ``from_hf``; a family whose
        converter handles tensors the model does not (MLA linear biases) reads them here."""
        fn = self.from_hf_for_layout or self.from_hf
        return fn(hf, source)


_FAMILIES: Dict[str, FamilySpec] = {}
_NAMES: Dict[str, str] = {}          # every name, alias and --model-type-hf name -> family
_HF_TYPES: Dict[str, str] = {}       # config.json model_type -> family
_loaded = False
_PACKAGE = "ms_llm.models.families"


def register_family(spec: FamilySpec) -> FamilySpec:
    """Add a family. Its names, aliases, ``--model-type-hf`` names and HF ``model_type`` must not
    belong to another family (re-registering the same record is a no-op)."""
    if _FAMILIES.get(spec.name) is spec:
        return spec
    if spec.name in _FAMILIES:
        raise ValueError(f"register_family: family {spec.name!r} is already registered")
    names = {spec.name, *spec.aliases, *spec.megatron_names}
    taken = sorted(n for n in names if _NAMES.get(n, spec.name) != spec.name)
    if taken:
        raise ValueError(f"register_family {spec.name!r}: name(s) {taken} belong to "
                         f"{sorted({_NAMES[n] for n in taken})}")
    if spec.hf_model_type in _HF_TYPES:
        raise ValueError(f"register_family {spec.name!r}: model_type {spec.hf_model_type!r} "
                         f"belongs to {_HF_TYPES[spec.hf_model_type]!r}")
    _FAMILIES[spec.name] = spec
    for n in names:
        _NAMES[n] = spec.name
    _HF_TYPES[spec.hf_model_type] = spec.name
    return spec


def unregister_family(name: str) -> FamilySpec:
    """Remove a family and all its names (tests, or a plugin replacing a built-in family)."""
    spec = get_family(name)
    del _FAMILIES[spec.name]
    for n in [n for n, f in _NAMES.items() if f == spec.name]:
        del _NAMES[n]
    del _HF_TYPES[spec.hf_model_type]
    return spec


def _family_modules() -> List[str]:
    """Every package (folder) of ``ms_llm.models.families``: a family is a folder whose
    ``__init__`` calls ``register_family``; plain modules there (``common``, ``deepseek_moe``) are
    helpers families share. The original six first so listings keep their order."""
    pkg = importlib.import_module(_PACKAGE)
    found = sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if m.ispkg)
    return [m for m in BUILTIN_FAMILY_MODULES if m in found] + \
        [m for m in found if m not in BUILTIN_FAMILY_MODULES]


def _ensure_builtin() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for mod in _family_modules():
            importlib.import_module(f"{_PACKAGE}.{mod}")


def _package_of(spec: FamilySpec) -> str:
    """The family folder ``spec.from_hf`` is defined in (``ms_llm.models.families.<name>``), or
    its module when it comes from elsewhere."""
    module = getattr(spec.from_hf, "__module__", "") or ""
    return ".".join(module.split(".")[:4]) if module.startswith(_PACKAGE + ".") else module


def families() -> List[FamilySpec]:
    """All registered families: those of ``ms_llm.models.families`` in ``_family_modules``
    order, then any registered from elsewhere, in registration order."""
    _ensure_builtin()
    order = {f"{_PACKAGE}.{m}": i for i, m in enumerate(_family_modules())}
    return sorted(_FAMILIES.values(), key=lambda s: order.get(_package_of(s), len(order)))


def names() -> Dict[str, str]:
    """Every accepted name (canonical, alias, ``--model-type-hf``) -> canonical family name."""
    _ensure_builtin()
    return dict(_NAMES)


def get_family(name: str, what: str = "model.family") -> FamilySpec:
    """The family a name, alias or ``--model-type-hf`` name denotes; one line naming ``what``
    otherwise."""
    _ensure_builtin()
    key = _NAMES.get(name)
    if key is None:
        raise ValueError(f"{what}: unknown family {name!r}; known: {sorted(_FAMILIES)}")
    return _FAMILIES[key]


def family_for_hf(hf: Mapping, source: str = "config.json") -> FamilySpec:
    """The family of a ``config.json`` dict, by its ``model_type``."""
    _ensure_builtin()
    model_type = hf.get("model_type") if isinstance(hf, Mapping) else None
    if model_type not in _HF_TYPES:
        raise ValueError(f"{source}: model_type {model_type!r} is not supported; "
                         f"supported: {sorted(_HF_TYPES)}")
    return _FAMILIES[_HF_TYPES[model_type]]


def parse_hf_config(hf: Mapping, source: str = "config.json") -> Tuple[FamilySpec, TransformerConfig]:
    """The one parse of an HF ``config.json``: its family and TransformerConfig."""
    spec = family_for_hf(hf, source)
    return spec, spec.from_hf(hf, source)


def family_for_config(config: TransformerConfig) -> FamilySpec:
    """The family an unnamed TransformerConfig exports as (``ms-llm export``): the first family
    in ``claim_order`` whose ``claims`` accepts it."""
    _ensure_builtin()
    for spec in sorted(_FAMILIES.values(), key=lambda s: s.claim_order):
        if spec.claims(config):
            return spec
    raise ValueError("export: no registered family describes this model config")
