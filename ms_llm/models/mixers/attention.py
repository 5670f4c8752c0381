"""Softmax attention with fused QKV (``ms_llm.models.layers.SelfAttention``: grouped-query
attention, optional QKV bias, QK-norm, output gate), the default full attention."""
from __future__ import annotations

from .registry import ActivationBytes, MixerKind, register_mixer

FP32 = 4
# Copies of each attention activation MindSpore 2.10's CPU PyNative executor keeps per
# micro-batch and layer (fp32), in units of one tensor of that shape; fitted by
# tests/planning/test_memory_plan.py on measured peaks.
COPIES = {
    "qkv": 1.0,          # [T, (nh + 2 ng) d / tp]: q/k/v as split_heads makes them, q/k after
                         # RoPE (the fused QKV output is freed)
    # [s, s] terms of the BLAS causal attention kernel (ms_llm.ops.cpu_kernels): fitted on the
    # 55M model at seq 2048, micro-batch 1 (none / selective / full recompute: 3.40 / 2.21 /
    # 1.72 GB measured) and the tiny model at seq 512, micro-batch 2 (none / selective)
    "scores": 1.4,       # [b, nh / tp, s, s]: kept through forward (its probabilities)
    "scores_backward": 4.5,   # [nh / tp, s, s] (one sequence: the kernel's backward works a
                              # sequence at a time): made while a layer's backward runs
    "scores_backward_full": 0.9,   # the same, for a layer re-run by full recompute: a
    # compromise between the 55M model at seq 2048 (measured 1.72 GB on Zen 4: plan 0.79 of it
    # at 0.5, 0.82 at 1.0, 0.88 at 1.75) and the tests' tiny block recompute (measured 0.147 GB
    # in CI: 1.14 at 0.5, 1.17 at 1.0, 1.21 at 1.75); the re-run layer is not modelled more
    # closely than that
}


def softmax_attention_bytes(c, b: int, s: int, tp: int) -> ActivationBytes:
    """q/k/v and the ``[s, s]`` probabilities of one micro-batch (``b`` sequences of ``s``
    tokens, ``nh / tp`` heads)."""
    nh, ng, d = c.num_attention_heads // tp, c.num_query_groups // tp, c.kv_channels
    one_sequence = FP32 * nh * s * s
    return ActivationBytes(
        projections=int(FP32 * COPIES["qkv"] * b * s * (nh + 2 * ng) * d),
        core=int(COPIES["scores"] * b * one_sequence),
        transient=int(COPIES["scores_backward"] * one_sequence),
        rerun_transient=int(COPIES["scores_backward_full"] * one_sequence))


def softmax_attention_flops(c, seq_length: int, d_qk: int, d_v: int) -> int:
    """Training FLOPs per token of Q K^T and P V: forward ``2 * s * nh * (d_qk + d_v)``, times 3
    for forward + backward. Full (not causal) attention as in PaLM / torchtitan's
    ``12 * L * H * Q * T`` (= this with d_qk = d_v, summed over layers)."""
    return 6 * seq_length * c.num_attention_heads * (d_qk + d_v)


def _weights(c) -> int:
    h, nh, g, d = c.hidden_size, c.num_attention_heads, c.num_query_groups, c.kv_channels
    return h * nh * d + 2 * h * g * d + nh * d * h          # q, k, v, output projection


def _build(config):
    from ..layers import SelfAttention
    return SelfAttention(config)


ATTENTION = register_mixer(MixerKind(
    name="attention", title="softmax attention", build=_build,
    activation_bytes=softmax_attention_bytes, weights_per_token=_weights,
    mixing_flops_per_token=lambda c, s: softmax_attention_flops(c, s, c.kv_channels,
                                                                c.kv_channels)))
