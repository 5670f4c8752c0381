"""Optimizers, one registration per ``training.optimizer`` value (``registry``): AdamW
(``adamw``) and Muon (``muon``). Their update rules are the classes in ``ms_llm.optim``."""
from .registry import (OptimizerKind, get_optimizer, megatron_optimizers, optimizer_names,
                       optimizer_value_rule, register_optimizer, state_elements,
                       unregister_optimizer)

__all__ = ["OptimizerKind", "get_optimizer", "megatron_optimizers", "optimizer_names",
           "optimizer_value_rule", "register_optimizer", "state_elements",
           "unregister_optimizer"]
