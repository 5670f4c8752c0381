"""DeepSeek-V2 / V2-Lite (HF ``DeepseekV2ForCausalLM``): multi-head latent attention (with or
without a query LoRA: V2-Lite's plain ``q_proj``) and a softmax router (top-k of the softmax
over every expert, ``routed_scaling_factor``, ``first_k_dense_replace`` dense layers, shared
experts). MindSpeed-LLM builds it with the same ``deepseek_spec`` as DeepSeek-V3; its router
flags (``--moe-router-score-function`` absent: softmax) pick this family."""
from ...registry import register_family
from .spec import SPEC

register_family(SPEC)
