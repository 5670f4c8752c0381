"""Qwen3 (HF ``Qwen3ForCausalLM``): Llama with per-head RMSNorm on q and k (QK-norm) and an
explicit ``head_dim``."""
from ...registry import register_family
from .spec import SPEC

register_family(SPEC)
