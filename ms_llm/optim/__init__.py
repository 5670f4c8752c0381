"""Optimizers: one ``Optimizer`` protocol (``base``), the update rules (``adamw``, ``muon``), the
wrappers that run any of them on fp32 main parameters (``main_params``) or on data-parallel
shards (``distributed``), parameter groups by rule (``param_groups``) and ``build_optimizer``.

Layering: ``optim`` may import ``parallel`` (placements, the distributed optimizer's
collectives); ``parallel`` and ``models`` never import ``optim``; ``training`` builds the
optimizer through ``build_optimizer`` and talks to it through the protocol only."""
from .adamw import AdamW
from .base import Optimizer, StateTensor, Wrapper
from .build import build_optimizer, state_elements
from .distributed import DistributedOptimizer
from .main_params import MainParams
from .muon import Muon

__all__ = ["AdamW", "DistributedOptimizer", "MainParams", "Muon", "Optimizer", "StateTensor",
           "Wrapper",
           "build_optimizer", "state_elements"]
