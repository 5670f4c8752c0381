"""DeepSeek-V3 (HF ``DeepseekV3ForCausalLM``): multi-head latent attention (Megatron-Core's
MLATransformerConfig names: ``qk_head_dim`` = HF ``qk_nope_head_dim``, ``qk_pos_emb_head_dim`` =
``qk_rope_head_dim``) and the DeepSeek router (``deepseek_moe``)."""
from ...registry import register_family
from .spec import SPEC

register_family(SPEC)
