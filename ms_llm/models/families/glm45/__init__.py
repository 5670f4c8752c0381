"""GLM-4.5 (HF ``Glm4MoeForCausalLM``): grouped-query attention with partial rotary
(``partial_rotary_factor``), QKV bias (``attention_bias``) and optional QK-norm
(``use_qk_norm``), and the DeepSeek router (``deepseek_moe``)."""
from ...registry import register_family
from .spec import SPEC

register_family(SPEC)
