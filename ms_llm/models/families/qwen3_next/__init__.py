"""Qwen3-Next (HF ``Qwen3NextForCausalLM``): hybrid layers, Gated DeltaNet linear attention
(``layer_types`` "linear_attention") and gated full attention (every
``full_attention_interval``-th layer: output gate, partial rotary, QK-norm), zero-centred
RMSNorms (``1 + weight``), and Qwen3-MoE routing (softmax, top-k renormalised) with a shared
expert scaled by ``sigmoid(shared_expert_gate)``.

The per-layer token mixer is ``TransformerConfig.layer_types`` ("gated_delta_net" /
"attention"), which also names each layer's checkpoint layout (``layer_kinds``: "gated_delta_net"
/ "gated_attention", both in ``layouts``, registered here)."""
from ...layouts import register_layer_kind
from ...registry import register_family
from .layouts import GATED_ATTENTION, GATED_DELTA_NET
from .spec import SPEC

register_layer_kind("gated_attention", GATED_ATTENTION)
register_layer_kind("gated_delta_net", GATED_DELTA_NET)
register_family(SPEC)
