"""Optimizers, one registration per ``training.optimizer`` value (``registry``): AdamW
(``adamw``) and Muon (``muon``). Their update rules are the classes in ``ms_llm.optim``.

Every module of this package is a registration and is imported here (they import no MindSpore),
so a new built-in optimizer is one new module and nothing lists it."""
import importlib
import pkgutil

from .registry import (OptimizerKind, get_optimizer, megatron_optimizers, optimizer_names,
                       optimizer_value_rule, register_optimizer, state_elements,
                       unregister_optimizer)

__all__ = ["OptimizerKind", "get_optimizer", "megatron_optimizers", "optimizer_names",
           "optimizer_value_rule", "register_optimizer", "state_elements",
           "unregister_optimizer"]

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _module != "registry":
        importlib.import_module(f"{__name__}.{_module}")
