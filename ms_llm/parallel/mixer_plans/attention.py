"""Softmax attention with fused QKV: Megatron's column-parallel ``linear_qkv`` (whole query
groups per rank) and row-parallel ``linear_proj``; under context parallel its
``core_attention`` becomes ring / Ulysses attention."""
from __future__ import annotations

from . import MixerPlan, register_plan


def swap_core_attention(mixer, cp) -> None:
    """Context parallel of any mixer with a softmax ``core_attention`` submodule."""
    from ..context_parallel.apply import ContextParallelAttention
    mixer.core_attention = ContextParallelAttention(cp)


def _tensor_parallel(attn, tp) -> None:
    attn.linear_qkv = tp.column(attn.linear_qkv, overlap=True)
    attn.linear_proj = tp.row(attn.linear_proj, overlap=True)
    if attn.q_layernorm is not None:  # each rank sees only its heads
        tp.mark_partial(attn.q_layernorm)
        tp.mark_partial(attn.k_layernorm)


register_plan("attention", MixerPlan(tensor_parallel=_tensor_parallel,
                                     context_parallel=swap_core_attention))
