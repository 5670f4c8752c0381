"""Multi-head latent attention's parallel plan: Megatron-Core's MLA split for tensor parallel;
ring / Ulysses attention in place of its softmax core for context parallel."""
from __future__ import annotations

import functools

from .. import autograd as pa
from . import MixerPlan, register_plan
from .attention import swap_core_attention


def apply_mla_tensor_parallel(attn, tp) -> None:
    """Shard one ``MLASelfAttention`` over ``group`` in place (Megatron-Core's MLA split).

    The up-projections (``linear_q_up_proj`` or ``linear_q_proj``, ``linear_kv_up_proj``) are
    column-parallel over whole heads and ``linear_proj`` is row-parallel; the down-projections and
    their norms stay replicated (each rank computes the full, small latent). Their gradients are
    full on every rank, not partial: the column-parallel up-projections all-reduce the gradient of
    their input, and the rope key, which every rank's heads read but no column-parallel layer
    consumes, passes ``copy_to_group`` (identity forward, all-reduce backward) through the
    attention's ``rope_key_grad`` step.

    Sequence parallel: the attention's ``sequence_gather`` step all-gathers the input's sequence
    shards and, in backward, keeps this rank's shard of the gradient (no sum: by the above, the
    gradient of the gathered input is full and the same on every rank), and ``linear_proj``
    reduce-scatters its output back to the sequence shards."""
    group = tp.group
    if tp.sequence_parallel:
        attn.sequence_gather = functools.partial(pa.gather_from_group, group=group, dim=1)
    heads = attn.config.num_attention_heads
    if heads % group.size:
        raise ValueError(f"model.num_attention_heads ({heads}) is not divisible by "
                         f"parallel.tensor_model_parallel_size ({group.size})")
    if attn.linear_q_proj is not None:
        attn.linear_q_proj = tp.column(attn.linear_q_proj, sequence_parallel=False)
    else:
        attn.linear_q_up_proj = tp.column(attn.linear_q_up_proj, sequence_parallel=False)
    attn.linear_kv_up_proj = tp.column(attn.linear_kv_up_proj, sequence_parallel=False)
    attn.linear_proj = tp.row(attn.linear_proj)
    attn.rope_key_grad = functools.partial(pa.copy_to_group, group=group)


register_plan("mla", MixerPlan(tensor_parallel=apply_mla_tensor_parallel,
                               context_parallel=swap_core_attention))
