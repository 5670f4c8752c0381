"""Megatron-Core local-spec building blocks (names match its state-dict keys)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

from mindspore import Tensor, mint

from ms_llm import ops as hot
from ms_llm.compat import F, float32, nn
from .config import TransformerConfig
from .max_logit import max_attention_logits

if TYPE_CHECKING:
    from .kv_cache import LayerKVCache


class RMSNorm(nn.Module):
    """``zero_centered`` (Megatron's ``layernorm_zero_centered_gamma``, Qwen3-Next): the scale is
    ``1 + weight`` and ``weight`` starts at 0, so weight decay pulls the scale towards 1."""

    def __init__(self, hidden_size: int, eps: float, dtype="float32", zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.new_parameter((hidden_size,), fill=0.0 if zero_centered else 1.0,
                                       dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        if self.zero_centered:
            return hot.rms_norm(x, self.weight.astype(float32) + 1.0, self.eps)
        return hot.rms_norm(x, self.weight, self.eps)


def norm(config: TransformerConfig, size: int) -> RMSNorm:
    """The config's RMSNorm of width ``size``."""
    return RMSNorm(size, config.layernorm_epsilon, config.params_dtype,
                   config.layernorm_zero_centered_gamma)


def output_init_std(config: TransformerConfig) -> float:
    """Megatron's ``scaled_init_method_normal``: std / sqrt(2 * num_layers) for the linears that
    write into the residual stream (linear_proj, linear_fc2)."""
    return config.init_method_std / math.sqrt(2.0 * config.num_layers)


class CoreAttention(nn.Module):
    """``softmax(q k^T / sqrt(d) + mask) v`` (Megatron's ``core_attention``): its own module so
    that it can be recomputed (selective recompute) or swapped from outside; no parameters.

    ``record_max_logit`` (set by ``training.qk_clip``): each training forward folds the per-head
    max attention logit into ``current_max_attn_logits`` (Megatron-Core's name; the reader
    resets it to None)."""
    record_max_logit = False
    current_max_attn_logits: Optional[Tensor] = None

    def forward(self, q: Tensor, k: Tensor, v: Tensor,
                attention_mask: Optional[Tensor] = None) -> Tensor:
        if k.shape[2] == q.shape[2]:
            if self.record_max_logit and self.training:
                m = max_attention_logits(q, k, attention_mask)
                prev = self.current_max_attn_logits
                self.current_max_attn_logits = m if prev is None else mint.maximum(prev, m)
            return hot.causal_attention(q, k, v, attention_mask=attention_mask)
        return hot.cache_attention(q, k, v, attention_mask)     # queries over a KV cache


class SelfAttention(nn.Module):
    """Fused QKV in Megatron's per-query-group layout: for each of the ``ng`` groups, the rows
    ``[q (nh/ng * d) | k (d) | v (d)]``. Optional QKV bias (Qwen2.5) and QK-norm (Qwen3).
    ``attention_output_gate`` (Qwen3-Next, Megatron-Core's name) adds per group the gate rows
    ``[q | gate (nh/ng * d) | k | v]`` and multiplies the attention output by ``sigmoid(gate)``.

    The number of query groups is read from ``linear_qkv``'s output width at run time, so a
    layer whose QKV rows were split over tensor parallel (whole groups per rank) runs unchanged:
    only the heads per group and the head dim are fixed here."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        c = config
        nh, ng = c.num_attention_heads, c.num_query_groups
        self.heads_per_group, self.d = nh // ng, c.kv_channels
        self.gated = c.attention_output_gate
        qkv_out = (nh * (2 if self.gated else 1) + 2 * ng) * self.d
        self.linear_qkv = hot.Linear(c.hidden_size, qkv_out, bias=c.add_bias_linear or c.add_qkv_bias,
                                    init_std=c.init_method_std, dtype=c.params_dtype)
        if c.qk_layernorm:
            self.q_layernorm, self.k_layernorm = norm(c, self.d), norm(c, self.d)
        else:
            self.q_layernorm = self.k_layernorm = None
        self.linear_proj = hot.Linear(nh * self.d, c.hidden_size, bias=c.add_bias_linear,
                                     init_std=output_init_std(c), dtype=c.params_dtype)
        self.core_attention = CoreAttention()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor,
                attention_mask: Optional[Tensor] = None,
                kv_cache: Optional["LayerKVCache"] = None) -> Tensor:
        """``kv_cache``: this layer's cache; the new K/V are written into it and the queries
        attend over every filled slot (``attention_mask`` as ``KVCache.attention_mask`` makes
        it: over the whole buffer once the cache held something before this call)."""
        r, d = self.heads_per_group, self.d
        qkv = self.linear_qkv(x)
        b, s = qkv.shape[0], qkv.shape[1]  # the full sequence, also under sequence parallel
        rq = 2 * r if self.gated else r
        ng = qkv.shape[-1] // ((rq + 2) * d)
        qkv = qkv.reshape(b, s, ng, (rq + 2) * d)
        if self.gated:
            q, gate, k, v = hot.split_heads(qkv, (r, r, 1, 1))
            gate = hot.merge_heads(gate)
        else:
            q, k, v = hot.split_heads(qkv, (r, 1, 1))      # [b, nh, s, d], [b, ng, s, d] x 2
        if self.q_layernorm is not None:                   # per head vector: any layout
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q = hot.apply_rope(q, cos, sin)
        k = hot.apply_rope(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)      # the new K/V, or the whole cache buffer
        out = hot.merge_heads(self.core_attention(q, k, v, attention_mask))   # [b, s, nh * d]
        if self.gated:
            out = out * F.sigmoid(gate)
        return self.linear_proj(out)


class MLP(nn.Module):
    """``linear_fc2(act(linear_fc1(x)))``; with a gated unit ``linear_fc1`` holds ``[gate; up]``."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        c = config
        self.config = c
        fc1_out = c.ffn_hidden_size * (2 if c.gated_linear_unit else 1)
        self.linear_fc1 = hot.Linear(c.hidden_size, fc1_out, bias=c.add_bias_linear,
                                    init_std=c.init_method_std, dtype=c.params_dtype)
        self.linear_fc2 = hot.Linear(c.ffn_hidden_size, c.hidden_size, bias=c.add_bias_linear,
                                    init_std=output_init_std(c), dtype=c.params_dtype)

    def forward(self, x: Tensor) -> Tensor:
        h = self.linear_fc1(x)
        if self.config.swiglu:
            h = hot.swiglu(h)
        elif self.config.gated_linear_unit:
            gate, up = F.split(h, [h.shape[-1] // 2] * 2, -1)
            h = F.gelu(gate) * up
        else:
            h = F.silu(h) if self.config.activation_func == "silu" else F.gelu(h)
        return self.linear_fc2(h)


class TransformerLayer(nn.Module):
    """``attention`` / ``mlp`` plug in other modules (MLA, MoE); default the GQA ``SelfAttention``
    and the dense ``MLP``."""

    def __init__(self, config: TransformerConfig, mlp: Optional[nn.Module] = None,
                 attention: Optional[nn.Module] = None):
        super().__init__()
        c = config
        self.input_layernorm = norm(c, c.hidden_size)
        self.self_attention = attention if attention is not None else SelfAttention(c)
        self.pre_mlp_layernorm = norm(c, c.hidden_size)
        self.mlp = mlp if mlp is not None else MLP(c)
        self.hidden_dropout = c.hidden_dropout

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor,
                attention_mask: Optional[Tensor] = None,
                kv_cache: Optional["LayerKVCache"] = None) -> Tensor:
        x, residual = hot.fork(x)   # (x, x); bf16 on CPU: copies whose gradients one C op sums
        h = self.input_layernorm(x)
        if kv_cache is None:
            h = self.self_attention(h, cos, sin, attention_mask)
        else:
            h = self.self_attention(h, cos, sin, attention_mask, kv_cache=kv_cache)
        x, residual = hot.fork(hot.residual_add(residual, F.dropout(h, self.hidden_dropout,
                                                                    self.training)))
        h = self.mlp(self.pre_mlp_layernorm(x))
        return hot.residual_add(residual, F.dropout(h, self.hidden_dropout, self.training))
