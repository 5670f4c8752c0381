"""Llama 2 / Llama 3 (HF ``LlamaForCausalLM``): RMSNorm, SwiGLU, RoPE, GQA, no biases."""
from ...registry import register_family
from .spec import SPEC

register_family(SPEC)
