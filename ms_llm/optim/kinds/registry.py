"""The optimizer registry: one ``OptimizerKind`` record per ``training.optimizer`` value.

Generic code asks the selected kind for what it needs instead of testing the optimizer's name:
``build_optimizer`` for the inner optimizer's factory and the parameter groups, the config for
its keys' value rules (``ms_llm.config.values``) and its cross-key check (``ms_llm.config.
rules``), ``ms-llm plan`` for its fp32 state per parameter element (``state_elements``), the
MindSpeed translation for the ``--optimizer`` words that select it. A new optimizer is its update
rule (a class implementing ``ms_llm.optim.base.Optimizer``) and one ``register_optimizer`` call
in a module of this package (the package imports every module in it when it is imported, so
the built-ins are registered before anything asks), or from anywhere before the config is
loaded (a plugin, a test).

This module imports no MindSpore: the config schema validates through it in every command's
``--help`` path; each record's ``build`` imports its class when a run builds it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ms_llm.validation import Rule

__all__ = ["OptimizerKind", "register_optimizer", "unregister_optimizer", "get_optimizer",
           "optimizer_names", "state_elements", "optimizer_value_rule", "megatron_optimizers"]

# ``param_rule``: the update rule a parameter takes, by (name, ndim): the name of its group
# (``param_groups.ParamGroup.optimizer``), e.g. Muon's matrices and AdamW's everything else.
ParamRule = Callable[[str, int], str]
# ``validate``: None, or (the keys the message is about, the message) as a config cross-key
# rule returns (``ms_llm.config.rules.Problem``).
Problem = Optional[Tuple[Sequence[str], str]]


def _accepts(cfg) -> Problem:
    return None


@dataclass(frozen=True, eq=False)      # identity: one record per kind
class OptimizerKind:
    """One optimizer.

    * ``name``: its ``training.optimizer`` value; ``title``: its name in messages;
    * ``build(cfg, groups, pstate, model_config)``: a factory ``make(named_params)`` of the
      update rule over fp32 parameters (model parameters, their fp32 main copies or the
      distributed optimizer's shards; the wrappers call it), with ``groups`` (parameter name ->
      ``ParamGroup``, computed on the model's parameters);
    * ``state_elements(name, shape)``: fp32 state values per element of parameter ``name``
      (global ``shape``): what ``ms-llm plan`` counts before anything is built;
    * ``param_rule(name, ndim)``: the group (update rule) of each parameter (None: every
      parameter takes ``name``);
    * ``value_rules``: the value rule of each config key it owns (``training.<key>``: checked
      when the key is parsed, printed by ``--help`` and the config reference);
    * ``validate(cfg)``: the layouts and combinations it does not support (a ``Problem``,
      checked with the config before anything starts);
    * ``check_shards(named_params, groups, pstate)``: under ``parallel.use_distributed_optimizer``,
      raise (one line) for the shards it cannot update (Muon needs every rank to hold rows of
      each matrix it gathers); None: any dim-0 shard is fine;
    * ``megatron_names``: Megatron's ``--optimizer`` words that select it, each with the other
      config keys the word sets (``dist_muon``: the distributed optimizer);
    * ``megatron_note(keys)``: a note the MindSpeed translation prints for it, given the keys
      translated so far (a default that differs from Megatron's), or None."""

    name: str
    title: str
    build: Callable[..., Callable[..., Any]]
    state_elements: Callable[[str, Tuple[int, ...]], int]
    param_rule: Optional[ParamRule] = None
    value_rules: Mapping[str, Rule] = field(default_factory=dict)
    validate: Callable[[Any], Problem] = _accepts
    check_shards: Optional[Callable[..., None]] = None
    megatron_names: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    megatron_note: Optional[Callable[[Mapping[str, Any]], Optional[str]]] = None

    @property
    def rule(self) -> Union[str, ParamRule]:
        """What ``param_groups.build_groups`` takes: the per-parameter rule, or this name."""
        return self.param_rule or self.name


_KINDS: Dict[str, OptimizerKind] = {}


def register_optimizer(kind: OptimizerKind) -> OptimizerKind:
    """Add an optimizer (re-registering the same record is a no-op). Its config keys must not
    be another kind's, nor its ``--optimizer`` words."""
    if _KINDS.get(kind.name) is kind:
        return kind
    if kind.name in _KINDS:
        raise ValueError(f"register_optimizer: optimizer {kind.name!r} is already registered")
    for other in _KINDS.values():
        for what, mine, theirs in (("config key", kind.value_rules, other.value_rules),
                                   ("--optimizer word", kind.megatron_names,
                                    other.megatron_names)):
            shared = sorted(set(mine) & set(theirs))
            if shared:
                raise ValueError(f"register_optimizer: {kind.name}'s {what} {shared[0]} is "
                                 f"already {other.name}'s")
    _KINDS[kind.name] = kind
    return kind


def unregister_optimizer(name: str) -> OptimizerKind:
    """Remove an optimizer (tests, or a plugin replacing a built-in one)."""
    return _KINDS.pop(get_optimizer(name).name)


def _kinds() -> List[OptimizerKind]:
    """Every kind in registration order (the built-ins first: the package registers them when
    it is imported)."""
    return list(_KINDS.values())


def optimizer_names() -> List[str]:
    """Every registered optimizer (the values ``training.optimizer`` accepts)."""
    return [k.name for k in _kinds()]


def get_optimizer(name: str, what: str = "training.optimizer") -> OptimizerKind:
    if name not in _KINDS:
        raise ValueError(f"{what}: unknown optimizer {name!r}; known: {', '.join(_KINDS)}")
    return _KINDS[name]


def state_elements(cfg, name: str, shape: Sequence[int]) -> int:
    """fp32 optimizer-state elements per element of parameter ``name`` (global ``shape``) under
    ``cfg``'s optimizer, for ``ms-llm plan`` (fp32 main copies are counted by the planner)."""
    return get_optimizer(cfg.training.optimizer).state_elements(name, tuple(shape))


def optimizer_value_rule(key: str) -> Optional[Rule]:
    """The value rule a registered optimizer gives config key ``key`` (None: none does)."""
    for kind in _kinds():
        if key in kind.value_rules:
            return kind.value_rules[key]
    return None


def megatron_optimizers() -> Dict[str, Tuple[OptimizerKind, Mapping[str, Any]]]:
    """Megatron's ``--optimizer`` word -> (the kind it selects, the other keys it sets)."""
    return {word: (kind, keys) for kind in _kinds() for word, keys in kind.megatron_names.items()}
