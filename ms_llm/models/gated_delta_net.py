"""Gated DeltaNet, the linear-attention token mixer of Qwen3-Next / Qwen3.5 hybrid layers.

Module and parameter names are MindSpeed-LLM's Qwen3-Next spec (its Megatron checkpoints use
them): ``in_proj_qkvz`` and ``in_proj_ba`` (rows grouped per key head: ``[q k v z]`` and
``[b a]`` of each of the ``linear_num_key_heads`` groups, HF's order), ``conv1d.weight``
``[C, 1, K]`` (depthwise causal convolution over the concatenated q/k/v channels), ``dt_bias``,
``A_log``, ``norm.weight`` (gated RMSNorm over each value head) and ``out_proj``.

Per token: ``beta = sigmoid(b)``, log-decay ``g = -exp(A_log) * softplus(a + dt_bias)``; q, k, v
pass the short convolution + SiLU, q and k are L2-normalised inside the delta rule
(``ms_llm.models.gated_delta_rule``), and the output is ``RMSNorm(o) * silu(z)`` per head.
Training runs the chunked form; with a cache (``LinearAttentionState``) a call continues the
cached conv inputs and recurrent state, one token at a time by the recurrent form.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
from mindspore import Tensor, mint

from ms_llm import ops as hot
from ms_llm.compat import F, float32, nn
from .config import TransformerConfig
from .gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from .kv_cache import KVCache, LayerKVCache
from .layers import output_init_std

__all__ = ["GatedDeltaNet", "GatedRMSNorm", "CausalConv1d", "ChunkGatedDeltaRule",
           "LinearAttentionState"]


class LinearAttentionState(LayerKVCache):
    """One DeltaNet layer's slot in a ``KVCache``: the last ``K - 1`` conv inputs ``[b, K-1, C]``
    and the recurrent state ``[b, hv, dk, dv]`` (``None`` before the first call), plus the fill
    ``length`` the model's positions read. A recurrence cannot be rewound: ``crop`` to 0 resets
    it, to anything shorter than what it holds raises. Left-padded batches are refused (the
    padding would enter the state)."""

    def __init__(self, owner: "KVCache"):
        super().__init__(owner.capacity or 1, owner.max_capacity)
        self.owner = owner
        self.conv: Optional[Tensor] = None
        self.recurrent: Optional[Tensor] = None
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    @length.setter
    def length(self, value: int) -> None:
        if value == 0:
            self.conv = self.recurrent = None
        elif value < getattr(self, "_length", 0):
            raise ValueError(f"KV cache crop to {value} of {self._length} positions: a Gated "
                             f"DeltaNet state cannot be rewound (not built); start a new cache")
        self._length = value

    def check_unpadded(self) -> None:
        if self.owner.padding.any():
            raise ValueError("generate: left-padded prompts are not built for Gated DeltaNet "
                             "layers (the padding would enter the recurrent state); pass "
                             "prompts of one length")


class GatedRMSNorm(nn.Module):
    """``rms_norm(x) * weight * silu(gate)`` in fp32 (the norm before the gate; weight 1-init)."""

    def __init__(self, size: int, eps: float, dtype="float32"):
        super().__init__()
        self.eps = eps
        self.weight = nn.new_parameter((size,), fill=1.0, dtype=dtype)

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        y = hot.rms_norm(x.astype(float32), self.weight.astype(float32), self.eps)
        return (y * F.silu(gate.astype(float32))).astype(x.dtype)


class CausalConv1d(nn.Module):
    """Depthwise causal convolution, torch's ``Conv1d(groups=C)`` weight layout ``[C, 1, K]``,
    no bias: ``out[t, c] = sum_j w[c, j] x[t - K + 1 + j, c]`` (K shifted slices, which is all
    a kernel of 4 needs)."""

    def __init__(self, channels: int, kernel: int, init_std: float, dtype="float32"):
        super().__init__()
        self.kernel = kernel
        self.weight = nn.new_parameter((channels, 1, kernel), std=init_std, dtype=dtype)

    def forward(self, x: Tensor, past: Optional[Tensor] = None) -> Tensor:
        """x ``[b, s, C]``; ``past`` ``[b, K-1, C]`` the inputs before x (zeros if None)."""
        b, s, ch = x.shape
        k = self.kernel
        if past is None:
            past = mint.zeros((b, k - 1, ch), dtype=x.dtype)
        # summed in fp32 and rounded once (a bf16 product per tap would round K times; and the
        # weight gradient's sum over tokens has no bf16 kernel on CPU)
        xp = F.cat([past.astype(x.dtype), x], 1).astype(float32)
        w = self.weight.reshape(ch, k).astype(float32)
        out = xp[:, 0:s] * w[:, 0]
        for j in range(1, k):
            out = out + xp[:, j:j + s] * w[:, j]
        return out.astype(x.dtype)


class ChunkGatedDeltaRule(nn.Module):
    """The chunked delta rule as a parameter-free module, the DeltaNet's counterpart of
    ``CoreAttention``: context parallel (``ms_llm.parallel``) swaps it from outside for the form
    that hands the recurrent state from rank to rank."""

    def __init__(self, chunk_size: int):
        super().__init__()
        self.chunk_size = chunk_size

    def forward(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                initial_state: Optional[Tensor] = None):
        return chunk_gated_delta_rule(q, k, v, g, beta, self.chunk_size,
                                      initial_state=initial_state)


class GatedDeltaNet(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        c = config
        self.config = c
        self.hk, self.hv = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        qkvz = 2 * self.key_dim + 2 * self.value_dim
        self.in_proj_qkvz = hot.Linear(c.hidden_size, qkvz, bias=False,
                                       init_std=c.init_method_std, dtype=c.params_dtype)
        self.in_proj_ba = hot.Linear(c.hidden_size, 2 * self.hv, bias=False,
                                     init_std=c.init_method_std, dtype=c.params_dtype)
        self.conv1d = CausalConv1d(2 * self.key_dim + self.value_dim, c.linear_conv_kernel_dim,
                                   c.init_method_std, c.params_dtype)
        self.dt_bias = nn.new_parameter((self.hv,), fill=1.0, dtype=c.params_dtype)
        # A = exp(A_log) in [1, 16] (MindSpeed / transformers draw it uniformly in (0, 16))
        self.A_log = nn.new_parameter((self.hv,), dtype=c.params_dtype,
                                      values=lambda: np.log(nn.rng().uniform(1.0, 16.0, self.hv)))
        self.core_delta_rule = ChunkGatedDeltaRule(c.linear_chunk_size)
        self.norm = GatedRMSNorm(self.dv, c.layernorm_epsilon, c.params_dtype)
        self.out_proj = hot.Linear(self.value_dim, c.hidden_size, bias=False,
                                   init_std=output_init_std(c), dtype=c.params_dtype)

    def make_cache(self, owner: KVCache) -> LinearAttentionState:
        """This layer's slot in ``owner`` (``KVCache.for_model`` asks each token mixer)."""
        return LinearAttentionState(owner)

    def _split(self, qkvz: Tensor, ba: Tensor):
        """Per key-head groups -> q, k ``[b, s, hk, dk]``, v, z ``[b, s, hv, dv]``, b, a
        ``[b, s, hv]`` (tensor parallel would hold whole groups)."""
        bs, s = qkvz.shape[0], qkvz.shape[1]
        r = self.hv // self.hk
        groups = qkvz.shape[-1] // (2 * self.dk + 2 * r * self.dv)
        qkvz = qkvz.reshape(bs, s, groups, -1)
        q, k, v, z = F.split(qkvz, [self.dk, self.dk, r * self.dv, r * self.dv], -1)
        ba = ba.reshape(bs, s, groups, 2 * r)
        beta, a = F.split(ba, [r, r], -1)
        return (q, k, v.reshape(bs, s, groups * r, self.dv), z.reshape(bs, s, groups * r, self.dv),
                beta.reshape(bs, s, groups * r), a.reshape(bs, s, groups * r))

    def forward(self, x: Tensor, cos: Tensor = None, sin: Tensor = None,
                attention_mask: Optional[Tensor] = None,
                kv_cache: Optional[LinearAttentionState] = None) -> Tensor:
        """``cos``/``sin`` are unused (no positions in a recurrence); ``attention_mask`` only as
        an inference cache passes it (padding and packed documents are not built here)."""
        # a mask object that says it is the plain causal mask (context parallel's micro-batch
        # plan, ``causal`` True without packed documents) asks nothing of a recurrence
        if attention_mask is not None and kv_cache is None and \
                not getattr(attention_mask, "causal", False):
            raise ValueError("gated_delta_net: attention masks (padding, packed documents) are "
                             "not built for Gated DeltaNet layers")
        if kv_cache is not None:
            kv_cache.check_unpadded()
        qkvz = self.in_proj_qkvz(x)
        # the projections' sequence (sequence parallel gathers x's shards in them)
        bs, s = qkvz.shape[0], qkvz.shape[1]
        q, k, v, z, b, a = self._split(qkvz, self.in_proj_ba(x))
        groups = q.shape[2]
        mixed = F.cat([q.reshape(bs, s, -1), k.reshape(bs, s, -1), v.reshape(bs, s, -1)], -1)
        past = kv_cache.conv if kv_cache is not None else None
        conv_in = mixed
        mixed = F.silu(self.conv1d(mixed, past))
        if kv_cache is not None:
            keep = self.conv1d.kernel - 1
            full = conv_in if past is None else F.cat([past.astype(conv_in.dtype), conv_in], 1)
            if full.shape[1] < keep:
                full = F.cat([mint.zeros((bs, keep - full.shape[1], full.shape[2]),
                                         dtype=full.dtype), full], 1)
            kv_cache.conv = full[:, full.shape[1] - keep:]
        kd = groups * self.dk
        q, k, v = F.split(mixed, [kd, kd, mixed.shape[-1] - 2 * kd], -1)
        hv = v.shape[-1] // self.dv
        r = hv // groups
        q = F.broadcast_to(q.reshape(bs, s, groups, 1, self.dk), (bs, s, groups, r, self.dk))
        k = F.broadcast_to(k.reshape(bs, s, groups, 1, self.dk), (bs, s, groups, r, self.dk))
        q, k = q.reshape(bs, s, hv, self.dk), k.reshape(bs, s, hv, self.dk)
        v = v.reshape(bs, s, hv, self.dv)
        beta = F.sigmoid(b.astype(float32))
        g = -F.exp(self.A_log.astype(float32)) * \
            F.softplus(a.astype(float32) + self.dt_bias.astype(float32))
        state = kv_cache.recurrent if kv_cache is not None else None
        if kv_cache is not None and s == 1 and state is not None:
            out, state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state)
        else:
            out, state = self.core_delta_rule(q, k, v, g, beta, initial_state=state)
        if kv_cache is not None:
            kv_cache.recurrent = state
            kv_cache.length = kv_cache.length + s
        out = self.norm(out, z)                                       # [b, s, hv, dv]
        return self.out_proj(out.reshape(bs, s, hv * self.dv).astype(x.dtype))
