"""LoRA fine-tuning: adapters on the base weights of ``checkpoint.load``.

``apply_lora`` (the ``lora:`` section; a module conversion run by ``parallelize_model`` before
tensor parallel and FSDP), the adapter modules and ``adapters_disabled`` (``modules``), and the
adapters' life outside training: merging into base weights, PEFT's adapter layout and the base
fingerprint checkpoints record (``merge``, ``peft``, ``base``).
"""
from .modules import (LoRAColumnParallelLinear, LoRALinear, LoRARowParallelLinear,
                      adapters_disabled, is_frozen_base, lora_modules)
from .apply import apply_lora, count_parameters, select_targets, trainable_report

__all__ = ["LoRALinear", "LoRAColumnParallelLinear", "LoRARowParallelLinear",
           "adapters_disabled", "is_frozen_base", "lora_modules", "apply_lora",
           "count_parameters", "select_targets", "trainable_report"]
