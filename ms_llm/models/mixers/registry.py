"""The token-mixer registry: one ``MixerKind`` record per kind of ``self_attention`` slot.

A decoder layer is a token mixer (softmax attention, multi-head latent attention, Gated
DeltaNet, ...) and an MLP. Generic code (the model builder, the config check, FLOP counting,
the memory plan, the checkpoint layouts) asks the layer's kind for what it needs instead of
testing the kind's name, so a new mixer is its module, its parallel plans
(``ms_llm.parallel.mixer_plans``) and one ``register_mixer`` call in a module of this package
(imported on first use, like the model families).

``model.layer_types`` names each decoder layer's kind; the word ``"attention"`` there (and every
layer when ``layer_types`` is unset, and every multi-token-prediction layer, as Megatron-Core's
MTP block takes the attention spec) means the model's full attention: the kind whose
``selected_by(config)`` holds (multi-head latent attention under
``model.multi_latent_attention``), else the plain ``"attention"`` kind.

This module imports no MindSpore: the config schema validates through it in every command's
``--help`` path; each record's ``build`` imports its module when a model is built.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, NamedTuple, Optional, Tuple

if TYPE_CHECKING:
    from ..config import TransformerConfig

__all__ = ["MixerKind", "ActivationBytes", "FULL_ATTENTION", "register_mixer",
           "unregister_mixer", "get_mixer",
           "mixer_names", "mixer_of", "layer_mixer", "full_attention", "mixers_used",
           "validate_mixers"]

# The ``model.layer_types`` word for "this model's full attention" (see the module docstring).
FULL_ATTENTION = "attention"


class ActivationBytes(NamedTuple):
    """One mixer's activation memory for one micro-batch (bytes, this rank's heads):
    ``projections`` kept through forward (q/k/v as the kernel consumes them); ``core`` kept by
    the mixing core (attention probabilities; what selective recompute drops); ``transient``
    made while one layer's backward runs; ``rerun_transient`` the same for a layer whose forward
    re-runs inside its backward (full recompute)."""
    projections: int
    core: int
    transient: int
    rerun_transient: int


def _accepts(config: "TransformerConfig") -> None:
    return None


@dataclass(frozen=True, eq=False)      # identity: one record per kind
class MixerKind:
    """One token mixer.

    * ``title``: its name in messages;
    * ``build(config)``: the module (parallelism-free, Megatron-Core's names);
    * ``validate(config)``: one-line ``ValueError`` (naming the ``model.*`` key) for a config
      this kind cannot run; called for every kind the config uses;
    * ``selected_by(config)``: this kind is the model's full attention (``None``: never; the
      plain ``"attention"`` kind is the fallback);
    * ``checkpoint_kind``: the per-layer layout name the converters use (``ms_llm.models.
      layouts``; a family may rename it, e.g. Qwen3-Next's gated attention);
    * ``core_attention``: the module has a softmax ``core_attention`` submodule, which selective
      recompute re-runs and context parallel replaces by ring / Ulysses attention (otherwise the
      kind's own context-parallel plan handles the sequence split);
    * ``activation_bytes(config, b, s, tp)``: its memory-plan term (``ActivationBytes``), with
      the copy counts MindSpore's executor was measured to keep;
    * ``weights_per_token(config)`` / ``mixing_flops_per_token(config, s)``: multiply-accumulates
      of its weight matmuls per token, and training FLOPs per token of the mixing itself (the
      MFU count, ``ms_llm.planning.flops``);
    * ``layout_sizes(config)``: the sizes its checkpoint layout reads beyond the attention
      ones (``ModelSpec.linear``: a linear-attention kind's key / value heads and head sizes
      and its convolution kernel), or None when the layout needs none;
    * ``twin_widths(config, unit)``: its own ``model.*`` widths shrunk to multiples of ``unit``
      (counts kept), for the small *twin* ``ms-llm plan`` really builds
      (``ms_llm.parallel.plan_shapes.twin_config``); ``{}``: the kind has no widths of its own."""

    name: str
    title: str          # what messages call it ("Gated DeltaNet")
    build: Callable[["TransformerConfig"], Any]
    activation_bytes: Callable[["TransformerConfig", int, int, int], ActivationBytes]
    weights_per_token: Callable[["TransformerConfig"], int]
    mixing_flops_per_token: Callable[["TransformerConfig", int], int]
    validate: Callable[["TransformerConfig"], None] = _accepts
    selected_by: Optional[Callable[["TransformerConfig"], bool]] = None
    checkpoint_kind: Optional[str] = None
    core_attention: bool = True
    megatron_training_checkpoints: bool = True
    layout_sizes: Optional[Callable[["TransformerConfig"], Tuple[int, ...]]] = None
    twin_widths: Callable[["TransformerConfig", int], Dict[str, int]] = lambda c, unit: {}

    @property
    def layout(self) -> str:
        return self.checkpoint_kind or self.name

    def make(self, config: "TransformerConfig"):
        """The module, tagged with its kind (``mixer_of``): code applied from outside (parallel
        plans) finds a layer's kind from the module, on any pipeline stage."""
        module = self.build(config)
        module.mixer_kind = self.name
        return module


def mixer_of(module) -> MixerKind:
    """The kind a mixer module was built as (``MixerKind.make``)."""
    name = getattr(module, "mixer_kind", None)
    if name is None:
        raise ValueError(f"{type(module).__name__} was not built by a registered token mixer "
                         f"(ms_llm.models.mixers)")
    return get_mixer(name)


_KINDS: Dict[str, MixerKind] = {}
_loaded = False


def register_mixer(kind: MixerKind) -> MixerKind:
    """Add a token-mixer kind (re-registering the same record is a no-op)."""
    if _KINDS.get(kind.name) is kind:
        return kind
    if kind.name in _KINDS:
        raise ValueError(f"register_mixer: mixer kind {kind.name!r} is already registered")
    _KINDS[kind.name] = kind
    return kind


def unregister_mixer(name: str) -> MixerKind:
    """Remove a kind (tests, or a plugin replacing a built-in kind)."""
    return _KINDS.pop(get_mixer(name).name)


def _ensure_builtin() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        pkg = importlib.import_module(__package__)
        for mod in sorted(m.name for m in pkgutil.iter_modules(pkg.__path__)):
            if mod != "registry":
                importlib.import_module(f"{__package__}.{mod}")


def mixer_names() -> List[str]:
    """Every registered kind (the values ``model.layer_types`` accepts)."""
    _ensure_builtin()
    return sorted(_KINDS)


def get_mixer(name: str, what: str = "model.layer_types") -> MixerKind:
    _ensure_builtin()
    if name not in _KINDS:
        raise ValueError(f"{what}: unknown token mixer {name!r}; known: {sorted(_KINDS)}")
    return _KINDS[name]


def full_attention(config: "TransformerConfig") -> MixerKind:
    """The model's full attention: the kind ``selected_by`` the config, else plain attention."""
    _ensure_builtin()
    chosen = [k for k in _KINDS.values() if k.selected_by is not None and k.selected_by(config)]
    if len(chosen) > 1:
        raise ValueError(f"model: the switches of {sorted(k.name for k in chosen)} are set "
                         f"together; a model has one full attention")
    return chosen[0] if chosen else get_mixer(FULL_ATTENTION)


def layer_mixer(config: "TransformerConfig", layer_idx: int) -> MixerKind:
    """The kind of layer ``layer_idx`` (an index >= ``num_layers``: an MTP layer, full
    attention)."""
    lt = config.layer_types
    name = lt[layer_idx] if lt is not None and layer_idx < config.num_layers else FULL_ATTENTION
    return full_attention(config) if name == FULL_ATTENTION else get_mixer(name)


def mixers_used(config: "TransformerConfig") -> List[MixerKind]:
    """Every kind the config builds (its full attention always: the MTP layers use it)."""
    used = {full_attention(config)}
    used.update(layer_mixer(config, i) for i in range(config.num_layers))
    return sorted(used, key=lambda k: k.name)


def validate_mixers(config: "TransformerConfig") -> None:
    """``model.layer_types`` names a registered kind per layer, and each kind used accepts the
    config."""
    lt = config.layer_types
    if lt is not None:
        known = mixer_names()
        if len(lt) != config.num_layers or any(t not in known for t in lt):
            raise ValueError(f"model.layer_types {lt} must name one of {known} per layer "
                             f"(num_layers={config.num_layers})")
    for kind in mixers_used(config):
        kind.validate(config)
