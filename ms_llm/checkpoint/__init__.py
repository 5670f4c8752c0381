"""Checkpoint formats and conversion (Hugging Face folders now; Megatron layouts: issue 3)."""
from .pretrained import from_pretrained

__all__ = ["from_pretrained"]
