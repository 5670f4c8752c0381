"""Megatron-Core-shaped GPT models (model code only; no parallelism), the model-family
registry (``ms_llm.models.registry``, one folder per family under ``families/``) and the HF <->
Megatron state-dict layouts (``ms_llm.models.layouts``, pure numpy).

``GPTModel`` is imported on first use (PEP 562): the config schema (``TransformerConfig``, the
family registry) is needed by every command's ``--help`` and config check, which should not pay
for importing MindSpore. Loading weights is ``ms_llm.checkpoint.from_pretrained`` (models never
import checkpoint code).
"""
from .config import TransformerConfig
from .families import config_from_hf, family_defaults
from .registry import FamilySpec, family_for_hf, get_family, register_family


def __getattr__(name: str):
    if name == "GPTModel":
        from .gpt import GPTModel
        return GPTModel
    if name == "FAMILIES":
        from . import families
        return families.FAMILIES
    raise AttributeError(f"module 'ms_llm.models' has no attribute {name!r}")


__all__ = ["TransformerConfig", "GPTModel", "FAMILIES", "family_defaults", "config_from_hf",
           "FamilySpec", "register_family", "get_family", "family_for_hf"]
