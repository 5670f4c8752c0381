"""LoRA fine-tuning: adapters on the base weights of ``checkpoint.load``.

``apply_lora`` (the ``lora:`` section; a module conversion run by ``parallelize_model`` before
tensor parallel and FSDP; ``apply``), the adapter modules and ``adapters_disabled``
(``modules``) and the base fingerprint checkpoints record (``base``). Merging adapters into base
weights and ``ms-llm export`` of LoRA checkpoints (merged or in PEFT's layout) are checkpoint
conversions: ``ms_llm.checkpoint.adapters.merge`` / ``ms_llm.checkpoint.adapters.export``. Names
are imported lazily: ``base`` runs without MindSpore.
"""
import importlib

_WHERE = {"LoRALinear": "modules", "adapters_disabled": "modules",
          "is_frozen_base": "modules", "lora_modules": "modules",
          "lora_module_names": "modules", "apply_lora": "apply",
          "count_parameters": "apply", "select_targets": "apply", "trainable_report": "apply"}
__all__ = sorted(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
