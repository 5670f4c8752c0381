"""Hot ops with one fast path per device: Ascend fused kernels, C++ AOT kernels on CPU, and a
composed fallback that always works (``MS_LLM_DISABLE_AOT=1`` forces it)."""
from ._dispatch import aot_enabled, resolve_paths
from .attention import cache_attention, causal_attention
from .cross_entropy import IGNORE_INDEX, cross_entropy
from .fused_cross_entropy import fused_linear_cross_entropy
from .linear import Linear, bmm, linear
from .stream import (Embedding, cast, embedding, fork, merge_heads, residual_add, split_heads,
                     split_last)
from .rms_norm import rms_norm
from .rope import apply_rope, rope_cos_sin
from .swiglu import swiglu

__all__ = ["causal_attention", "cache_attention", "cross_entropy", "fused_linear_cross_entropy",
           "IGNORE_INDEX", "rms_norm",
           "apply_rope", "rope_cos_sin", "swiglu", "linear", "bmm", "Linear", "resolve_paths",
           "aot_enabled",
           "residual_add", "fork", "embedding", "Embedding", "split_last", "split_heads",
           "merge_heads", "cast"]
