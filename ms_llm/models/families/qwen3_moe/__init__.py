"""Qwen3-MoE (HF ``Qwen3MoeForCausalLM``): Qwen3 attention and dropless MoE MLPs
(``Qwen3MoeSparseMoeBlock``: softmax router, top-k, ``norm_topk_prob`` renormalises the k
weights = Megatron's top-k-then-softmax, ``moe_router_pre_softmax`` false; no shared experts)."""
from ...registry import register_family
from .spec import SPEC

register_family(SPEC)
