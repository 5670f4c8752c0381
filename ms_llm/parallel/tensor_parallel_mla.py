"""Tensor parallel for multi-head latent attention (Megatron-Core's MLA split).

The up-projections (``linear_q_up_proj`` or ``linear_q_proj``, ``linear_kv_up_proj``) are
column-parallel over whole heads and ``linear_proj`` is row-parallel; the down-projections and
their norms stay replicated (each rank computes the full, small latent). Their gradients are
full on every rank, not partial: the column-parallel up-projections all-reduce the gradient of
their input, and the rope key, which every rank's heads read but no column-parallel layer
consumes, passes ``copy_to_group`` (identity forward, all-reduce backward) through the
attention's ``rope_key_grad`` step."""
from __future__ import annotations

import functools

from . import autograd as pa
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear


def apply_mla_tensor_parallel(attn, group, sequence_parallel: bool = False) -> None:
    """Shard one ``MLASelfAttention`` over ``group`` in place."""
    if sequence_parallel:
        raise ValueError("parallel.sequence_parallel with model.multi_latent_attention is not "
                         "built yet (the replicated down-projections would see a sequence "
                         "shard)")
    heads = attn.config.num_attention_heads
    if heads % group.size:
        raise ValueError(f"model.num_attention_heads ({heads}) is not divisible by "
                         f"parallel.tensor_model_parallel_size ({group.size})")
    if attn.linear_q_proj is not None:
        attn.linear_q_proj = ColumnParallelLinear(attn.linear_q_proj, group)
    else:
        attn.linear_q_up_proj = ColumnParallelLinear(attn.linear_q_up_proj, group)
    attn.linear_kv_up_proj = ColumnParallelLinear(attn.linear_kv_up_proj, group)
    attn.linear_proj = RowParallelLinear(attn.linear_proj, group)
    attn.rope_key_grad = functools.partial(pa.copy_to_group, group=group)
