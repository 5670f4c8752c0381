"""Parameter groups by rule, as Megatron-Core's ``_get_param_groups`` builds them.

Every trainable parameter gets a key ``(optimizer, wd_mult, lr_mult)``:

* no weight decay (``wd_mult`` 0) on biases and 1-D tensors (norm weights, expert biases),
  Megatron's default ``no_weight_decay_cond``;
* ``lr_mult``: ``scale_lr(name, param)`` selects parameters whose learning rate is multiplied
  by ``lr_mult`` (Megatron's ``scale_lr_cond`` / ``lr_mult``); none by default;
* ``optimizer``: which update rule the parameter takes, the selected optimizer's
  ``param_rule`` (``ms_llm.optim.kinds``): its own name everywhere (AdamW), or with Muon the
  2-D hidden matrices (``is_muon_matrix``) Muon's and the rest (embedding, output layer, norms,
  biases, router and expert-bias vectors) AdamW's, as Megatron-Core's Muon setup splits them.

The groups are printed once at the start of training (``describe``). A step applies
``lr * lr_mult`` and ``weight_decay * wd_mult`` to each parameter of a group.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple, Union

if TYPE_CHECKING:      # no MindSpore at import: the optimizer registrations use this module
    from mindspore import Parameter

Key = Tuple[str, float, float]     # (optimizer, wd_mult, lr_mult)
# The update rule of each parameter: one name for all, or a function of (name, ndim).
Rule = Union[str, Callable[[str, int], str]]


@dataclass
class ParamGroup:
    """Parameters sharing an update rule and multipliers."""
    optimizer: str
    wd_mult: float
    lr_mult: float
    names: List[str] = field(default_factory=list)
    numel: int = 0

    @property
    def key(self) -> Key:
        return (self.optimizer, self.wd_mult, self.lr_mult)

    @property
    def label(self) -> str:
        return f"{self.optimizer}{'' if self.wd_mult else ' no-decay'}" + \
            ("" if self.lr_mult == 1.0 else f" lr x{self.lr_mult:g}")


def no_weight_decay(name: str, ndim: int) -> bool:
    """Megatron's default: no weight decay on biases and 1-D tensors (norm weights)."""
    return ndim <= 1 or name.endswith(".bias")


def is_embedding_or_output(name: str) -> bool:
    """The word/position embeddings and the untied output layer (Megatron keeps them on Adam
    under Muon: they are lookup tables and a classifier, not hidden linear maps)."""
    return name.startswith(("embedding.", "output_layer.")) or ".embedding." in name \
        or ".output_layer." in name


def is_muon_matrix(name: str, ndim: int) -> bool:
    """A hidden linear weight Muon orthogonalises: a 2-D weight (grouped experts store a stack
    of them in 2-D; a conv kernel or other N-D tensor stays on AdamW, as in Megatron) that is
    not the embedding, the output layer or the MoE router (its rows are per-expert scores, kept
    on AdamW as the issue asks; Megatron would put it on Muon)."""
    if ndim != 2 or name.endswith(".bias") or is_embedding_or_output(name):   # Megatron: 2-D
        return False
    return ".router." not in name and not name.endswith("router.weight")


def matrices_rule(matrices: str, rest: str) -> Rule:
    """A rule giving the hidden matrices (``is_muon_matrix``) to optimizer ``matrices`` and
    every other parameter to ``rest`` (Muon's split)."""
    return lambda name, ndim: matrices if is_muon_matrix(name, ndim) else rest


def key_of(name: str, param: "Parameter", rule: Rule,
           scale_lr: Optional[Callable[[str, "Parameter"], bool]] = None,
           lr_mult: float = 1.0) -> Key:
    """The group key of one parameter (see the module docstring)."""
    wd = 0.0 if no_weight_decay(name, param.ndim) else 1.0
    lr = lr_mult if scale_lr is not None and scale_lr(name, param) else 1.0
    opt = rule if isinstance(rule, str) else rule(name, param.ndim)
    return (opt, wd, lr)


def build_groups(named_params: Sequence[tuple], rule: Rule,
                 scale_lr: Optional[Callable[[str, "Parameter"], bool]] = None,
                 lr_mult: float = 1.0) -> List[ParamGroup]:
    """The groups of ``named_params`` in first-seen order (each name in exactly one); ``rule``:
    the optimizer's (``OptimizerKind.rule``)."""
    groups: Dict[Key, ParamGroup] = {}
    for n, p in named_params:
        k = key_of(n, p, rule, scale_lr, lr_mult)
        g = groups.setdefault(k, ParamGroup(*k))
        g.names.append(n)
        g.numel += int(p.size)
    return list(groups.values())


def assignment(groups: Sequence[ParamGroup]) -> Dict[str, ParamGroup]:
    """Parameter name -> its group."""
    return {n: g for g in groups for n in g.names}


def describe(groups: Sequence[ParamGroup]) -> List[str]:
    """One line per group, for the start-of-training log."""
    return [f"param group {g.label}: {len(g.names)} tensors, {g.numel / 1e6:.2f}M elements "
            f"(lr x{g.lr_mult:g}, weight decay x{g.wd_mult:g})" for g in groups]
