"""Optimizers: one ``Optimizer`` protocol (``base``), the update rules (``adamw``, ``muon``), one
registration per ``training.optimizer`` value (``kinds``), the wrappers that run any of them on
fp32 main parameters (``main_params``) or on data-parallel shards (``distributed``), parameter
groups by rule (``param_groups``) and ``build_optimizer``.

The classes are imported on first use (PEP 562): the config schema validates
``training.optimizer`` and the optimizers' keys through ``kinds`` in every command's ``--help``
path, which should not pay for importing MindSpore.

Layering: ``optim`` may import ``parallel`` (placements, the distributed optimizer's
collectives); ``parallel`` and ``models`` never import ``optim``; ``training`` builds the
optimizer through ``build_optimizer`` and talks to it through the protocol only."""
import importlib

from .kinds import state_elements

# name -> the module (relative) that defines it
_LAZY = {"AdamW": ".adamw", "Muon": ".muon", "Optimizer": ".base", "StateTensor": ".base",
         "Wrapper": ".base", "build_optimizer": ".build", "DistributedOptimizer": ".distributed",
         "MainParams": ".main_params"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AdamW", "DistributedOptimizer", "MainParams", "Muon", "Optimizer", "StateTensor",
           "Wrapper",
           "build_optimizer", "state_elements"]
