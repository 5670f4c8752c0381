"""Megatron-Core-shaped GPT models (model code only; no parallelism).

``GPTModel`` is imported on first use (PEP 562): the config schema (``TransformerConfig``,
``FAMILIES``) is needed by every command's ``--help`` and config check, which should not pay
for importing MindSpore.
"""
from .config import TransformerConfig
from .families import FAMILIES, config_from_hf, family_defaults


def from_pretrained(path: str, dtype=None, config=None):
    """Build a GPTModel from a Hugging Face folder; see ``ms_llm.checkpoint.from_pretrained``."""
    from ms_llm.checkpoint.pretrained import from_pretrained as _load
    return _load(path, dtype=dtype, config=config)


def __getattr__(name: str):
    if name == "GPTModel":
        from .gpt import GPTModel
        return GPTModel
    raise AttributeError(f"module 'ms_llm.models' has no attribute {name!r}")


__all__ = ["TransformerConfig", "GPTModel", "FAMILIES", "family_defaults", "config_from_hf",
           "from_pretrained"]
