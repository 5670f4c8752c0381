"""Megatron-Core-shaped GPT models (model code only; no parallelism)."""
from .config import TransformerConfig
from .families import FAMILIES, config_from_hf, family_defaults
from .gpt import GPTModel


def from_pretrained(path: str, dtype=None, config=None) -> GPTModel:
    """Build a GPTModel from a Hugging Face folder; see ``ms_llm.checkpoint.from_pretrained``."""
    from ms_llm.checkpoint.pretrained import from_pretrained as _load
    return _load(path, dtype=dtype, config=config)


__all__ = ["TransformerConfig", "GPTModel", "FAMILIES", "family_defaults", "config_from_hf",
           "from_pretrained"]
