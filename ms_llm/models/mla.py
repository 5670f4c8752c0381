"""Multi-head latent attention (DeepSeek-V2/V3) with Megatron-Core's ``MLASelfAttention`` names.

``decoder.layers.{i}.self_attention`` holds

* ``linear_q_down_proj`` ``[q_lora_rank, H]`` -> ``q_layernorm`` -> ``linear_q_up_proj``
  ``[nh * (qk_head_dim + qk_pos_emb_head_dim), q_lora_rank]``; or, without ``q_lora_rank``,
  ``linear_q_proj`` ``[nh * (qk + rope), H]`` (HF ``q_a_proj`` / ``q_a_layernorm`` /
  ``q_b_proj`` / ``q_proj``);
* ``linear_kv_down_proj`` ``[kv_lora_rank + rope, H]`` (HF ``kv_a_proj_with_mqa``): the
  compressed kv and the one rope key every head shares; ``kv_layernorm`` on the compressed part;
  ``linear_kv_up_proj`` ``[nh * (qk + v_head_dim), kv_lora_rank]`` (HF ``kv_b_proj``);
* ``linear_proj`` ``[H, nh * v_head_dim]`` (HF ``o_proj``).

Per head ``q = [q_nope | q_rope]``, ``k = [k_nope | k_rope(shared)]``; the softmax scale is
``(qk + rope)^-0.5``, times ``mscale(factor, mscale_all_dim)^2`` under YaRN (HF and Megatron).
DeepSeek's weights lay the rope dims out as interleaved pairs; like Megatron-Core's MLA the
weights stay as released and the rope slice is de-interleaved at run time, then rotated with the
rotate-half tables every other model uses (``mla_rope_interleaved``; HF ``rope_interleave``).

The number of local heads is read from the up-projections' output width, so a layer whose
up-projections were split over tensor parallel (whole heads per rank) runs unchanged;
``rope_key_grad`` is the identity here and becomes an all-reduce in backward under tensor
parallel (the shared rope key feeds every rank's heads); ``sequence_gather`` is the identity
here and gathers a sequence-parallel shard of the input under sequence parallel. Inference caches the full per-head K
and V (V zero-padded to the K width), not the compressed latent.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

from mindspore import Tensor

from ms_llm import ops as hot
from ms_llm.compat import F, nn
from .config import TransformerConfig
from .layers import RMSNorm, output_init_std

if TYPE_CHECKING:
    from .kv_cache import LayerKVCache

# HF's DeepseekV3RMSNorm on q_a / kv_a is built without the config's eps (its default 1e-6).
MLA_NORM_EPS = 1e-6


def mla_softmax_scale(config: TransformerConfig) -> float:
    """``(qk + rope)^-0.5``, times ``(0.1 * mscale_all_dim * ln(factor) + 1)^2`` when the config
    has YaRN with ``mscale_all_dim`` (HF ``yarn_apply_mscale``; Megatron's ``_yarn_get_mscale``)."""
    c = config
    scale = (c.qk_head_dim + c.qk_pos_emb_head_dim) ** -0.5
    if c.position_embedding_type == "yarn" and c.yarn_mscale_all_dim:
        factor = c.yarn_rotary_scaling_factor
        if factor is None:
            original = c.yarn_original_max_position_embeddings or c.max_position_embeddings
            factor = c.max_position_embeddings / original
        if factor > 1:
            m = 0.1 * c.yarn_mscale_all_dim * math.log(factor) + 1.0
            scale *= m * m
    return scale


def deinterleave(x: Tensor) -> Tensor:
    """``[..., (x0, x1), (x2, x3), ...]`` -> ``[..., x0, x2, ..., x1, x3, ...]``."""
    shape = x.shape
    return x.reshape(*shape[:-1], shape[-1] // 2, 2).swapaxes(-1, -2).reshape(shape)


class MLACoreAttention(nn.Module):
    """Causal softmax attention at MLA's scale (its own module, like ``CoreAttention``)."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, q: Tensor, k: Tensor, v: Tensor,
                attention_mask: Optional[Tensor] = None) -> Tensor:
        if k.shape[2] == q.shape[2]:
            return hot.causal_attention(q, k, v, scale=self.scale, attention_mask=attention_mask)
        return hot.cache_attention(q, k, v, attention_mask, scale=self.scale)


def identity(x: Tensor) -> Tensor:
    return x


class MLASelfAttention(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        c = config
        self.config = c
        nh, H, dt, std = c.num_attention_heads, c.hidden_size, c.params_dtype, c.init_method_std
        self.qk, self.rope, self.v = c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim
        q_out = nh * (self.qk + self.rope)
        if c.q_lora_rank is None:
            self.linear_q_proj = hot.Linear(H, q_out, bias=False, init_std=std, dtype=dt)
            self.linear_q_down_proj = self.q_layernorm = self.linear_q_up_proj = None
        else:
            self.linear_q_proj = None
            self.linear_q_down_proj = hot.Linear(H, c.q_lora_rank, bias=c.add_bias_linear,
                                                 init_std=std, dtype=dt)
            self.q_layernorm = RMSNorm(c.q_lora_rank, MLA_NORM_EPS, dt)
            self.linear_q_up_proj = hot.Linear(c.q_lora_rank, q_out, bias=False, init_std=std,
                                               dtype=dt)
        self.linear_kv_down_proj = hot.Linear(H, c.kv_lora_rank + self.rope,
                                              bias=c.add_bias_linear, init_std=std, dtype=dt)
        self.kv_layernorm = RMSNorm(c.kv_lora_rank, MLA_NORM_EPS, dt)
        self.linear_kv_up_proj = hot.Linear(c.kv_lora_rank, nh * (self.qk + self.v), bias=False,
                                            init_std=std, dtype=dt)
        self.linear_proj = hot.Linear(nh * self.v, H, bias=c.add_bias_linear,
                                      init_std=output_init_std(c), dtype=dt)
        self.core_attention = MLACoreAttention(mla_softmax_scale(c))
        self.rope_key_grad = identity      # tensor parallel: all-reduce in backward
        self.sequence_gather = identity    # sequence parallel: gather the sequence shards

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if self.config.mla_rope_interleaved:
            x = deinterleave(x)
        return hot.apply_rope(x, cos, sin)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor,
                attention_mask: Optional[Tensor] = None,
                kv_cache: Optional["LayerKVCache"] = None) -> Tensor:
        qk, rope, vd = self.qk, self.rope, self.v
        x = self.sequence_gather(x)
        if self.linear_q_proj is not None:
            q = self.linear_q_proj(x)
        else:
            q = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x)))
        b, s = q.shape[0], q.shape[1]
        q = q.reshape(b, s, -1, qk + rope).swapaxes(1, 2)            # [b, nh, s, qk+rope]
        nh = q.shape[1]
        q_nope, q_pe = F.split(q, [qk, rope], -1)
        kv_c, k_pe = F.split(self.linear_kv_down_proj(x), [self.config.kv_lora_rank, rope], -1)
        kv = self.linear_kv_up_proj(self.kv_layernorm(kv_c))
        kv = kv.reshape(b, s, nh, qk + vd).swapaxes(1, 2)            # [b, nh, s, qk+v]
        k_nope, v = F.split(kv, [qk, vd], -1)
        k_pe = self._rope(self.rope_key_grad(k_pe).reshape(b, 1, s, rope), cos, sin)
        q = F.cat([q_nope, self._rope(q_pe, cos, sin)], -1)
        k = F.cat([k_nope, F.broadcast_to(k_pe, (b, nh, s, rope))], -1)
        # One width for q, k and v, so every attention kernel (and the KV cache) takes them;
        # zero columns add nothing to q.k and produce zero outputs that are cut off.
        width = max(qk + rope, vd)
        if vd < width:
            v = F.cat([v, F.zeros(b, nh, s, width - vd, dtype=v.dtype)], -1)
        if qk + rope < width:
            pad = F.zeros(b, nh, s, width - qk - rope, dtype=q.dtype)
            q, k = F.cat([q, pad], -1), F.cat([k, pad], -1)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
        out = self.core_attention(q, k, v, attention_mask)
        if vd < width:
            out = F.split(out, [vd, width - vd], -1)[0]
        return self.linear_proj(out.swapaxes(1, 2).reshape(b, s, nh * vd))
