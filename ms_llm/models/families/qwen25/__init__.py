"""Qwen2 / Qwen2.5 (HF ``Qwen2ForCausalLM``): Llama with q/k/v biases (no o_proj bias) and no
``head_dim`` key (head dim = hidden / heads)."""
from ...registry import register_family
from .spec import SPEC

register_family(SPEC)
