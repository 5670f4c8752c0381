"""Model FLOPs per token, achieved TFLOP/s and MFU, as Megatron-LM and torchtitan report them.

MFU ("model FLOPs utilization", PaLM, Chowdhery et al. 2022, appendix B) counts the FLOPs the
model *needs* per token, not what the kernels actually execute (recompute, padding, masked
attention blocks are not counted), and divides the achieved rate by the hardware's peak.
"""
from __future__ import annotations

from ms_llm.models.config import TransformerConfig
from ms_llm.models.mixers import layer_mixer


def matmul_weights_per_token(c: TransformerConfig) -> int:
    """Multiply-accumulates per token of every weight matmul (= the weights a token passes
    through): the token mixer's projections (its kind's ``weights_per_token``), the dense or
    MoE MLP with only the ``moe_router_topk`` routed experts a token visits plus shared experts
    and the router, and the output layer (the logits matmul runs even when tied to the embedding). The input
    embedding is a gather (no FLOPs); norms, RoPE, biases and activations are ignored, as in
    torchtitan and Megatron."""
    H = c.hidden_size
    mats = 3 if c.gated_linear_unit else 2                      # [gate; up], down
    dense_mlp = mats * H * c.ffn_hidden_size
    moe_mlp = mats * H * c.moe_ffn_hidden_size * c.moe_router_topk + \
        H * (c.num_moe_experts or 0)                            # routed experts + router
    if c.moe_shared_expert_intermediate_size:
        moe_mlp += 3 * H * c.moe_shared_expert_intermediate_size
        moe_mlp += H if c.moe_shared_expert_gate else 0
    total = 0
    for i in range(c.num_layers):
        total += layer_mixer(c, i).weights_per_token(c) + \
            (moe_mlp if c.is_moe_layer(i) else dense_mlp)
    return total + H * c.padded_vocab_size                      # output layer (logits)


def attention_flops_per_token(c: TransformerConfig, seq_length: int) -> int:
    """Training FLOPs per token of the token mixing itself, summed over layers: for softmax
    attention the two products Q K^T and P V (forward ``2 * s * nh * (d_qk + d_v)`` per layer,
    times 3 for forward + backward, full not causal as in PaLM / torchtitan); each mixer kind
    counts its own (``MixerKind.mixing_flops_per_token``)."""
    return sum(layer_mixer(c, i).mixing_flops_per_token(c, seq_length)
               for i in range(c.num_layers))


def flops_per_token(c: TransformerConfig, seq_length: int) -> int:
    """Training (forward + backward) model FLOPs per token:

        6 * N_active + 6 * L * s * nh * (d_qk + d_v)

    where ``N_active`` = :func:`matmul_weights_per_token` (2 FLOPs per multiply-accumulate in the
    forward pass, 4 in the backward pass for input and weight gradients: "6N", Kaplan et al. 2020,
    PaLM appendix B) and the second term is :func:`attention_flops_per_token`. For a dense
    Llama with d_qk = d_v = d this is torchtitan's ``6 * N + 12 * L * nh * d * s`` (torchtitan
    ``get_num_flop_per_token``, with N counting the output layer but not the input embedding);
    Megatron-LM's ``num_floating_point_operations`` counts the same matmuls (its MoE term also
    counts only the ``topk`` routed experts)."""
    return 6 * matmul_weights_per_token(c) + attention_flops_per_token(c, seq_length)


def achieved(tokens: int, step_time: float, flops_tok: int, peak_tflops: float) -> dict:
    """``tflops`` (achieved model TFLOP/s of this process' share of the step) and ``mfu``
    (tflops / peak_tflops, a fraction)."""
    tflops = tokens * flops_tok / step_time / 1e12 if step_time > 0 else 0.0
    return {"tflops": tflops, "mfu": tflops / peak_tflops if peak_tflops > 0 else 0.0}
