"""The fused one-token decode step of a ``TransformerLayer``
(``ms_llm.ops.cpu_kernels.decode.steps``).

Why: a PyNative decode step dispatched ~30 ops per layer; the layer's arithmetic at one token is a
few matrix-vector products, so dispatch set the token rate (0.24-0.38x transformers' ``generate``
on a 23M Qwen3). ``layer_step`` runs the layer's attention half as one kernel call and, for a
dense SwiGLU MLP, its MLP half as another; anything else the layer holds (MoE, MLA, Gated
DeltaNet, tensor-parallel or LoRA-wrapped linears, bf16 weights, training mode) keeps the
ordinary module path, which stays the reference the fused path is tested against
(``tests/models/test_decode_fast.py``).

``model_step`` goes further for a model whose every layer is covered (dense SwiGLU MLPs, a plain
embedding and LM head): the whole step, from the token ids to the next greedy tokens, is one C
call through ctypes (``decode.ModelStep``), which ``ms_llm.inference.generate`` takes first;
``layer_step`` serves the models it does not cover layer by layer
(``tests/models/test_decode_model_step.py``).

PyNative only: the kernels write the new K/V into the cache buffers in place.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

from mindspore import Tensor

from ms_llm import ops as hot
from ms_llm.compat import float32, nn
from .kv_cache import LayerKVCache
from .layers import MLP, RMSNorm, SelfAttention

if TYPE_CHECKING:
    from .kv_cache import KVCache
    from .layers import TransformerLayer

_STATE: dict = {}


def set_model_step(on: bool) -> bool:
    """Let ``generate`` take the whole-model step (True, the default) or stop at the per-layer
    fused calls (``benchmarks/generate.py`` compares the two); returns the previous setting."""
    before = _STATE.get("model_step", True)
    _STATE["model_step"] = bool(on)
    return before


def enabled() -> bool:
    """Whether decode steps take the fused kernels: CPU with the BLAS kernels (the library that
    holds them; ``runtime.blas_kernels: false`` turns both off), unless ``set_enabled(False)``."""
    if "linear" not in _STATE:
        _STATE["linear"] = hot.resolve_paths().get("linear") == "aot"
    if not _STATE["linear"]:
        return False
    from ms_llm.ops.cpu_kernels.decode import steps as decode
    return decode.available()


def set_enabled(on: bool) -> bool:
    """Turn the fused decode step (and the one-call cache attention) on or off: the module path
    is the reference tests and ``benchmarks/generate.py`` compare with. Returns the previous
    setting."""
    from ms_llm.ops.cpu_kernels.decode import steps as decode
    return decode.set_enabled(on)


def _plain_linear(m) -> bool:
    return type(m) is hot.Linear and m.weight.dtype == float32 and (
        m.bias is None or m.bias.dtype == float32)


def _plain_norm(m) -> bool:
    return type(m) is RMSNorm and m.weight.dtype == float32


def _attention_ok(layer, a) -> bool:
    # the kernels hold per-head maxima for at most 64 query heads per group
    if type(a) is not SelfAttention or a.heads_per_group > 64 or not (_plain_linear(a.linear_qkv)
                                            and _plain_linear(a.linear_proj)):
        return False
    norms = [layer.input_layernorm] + ([a.q_layernorm, a.k_layernorm]
                                       if a.q_layernorm is not None else [])
    return all(_plain_norm(n) and n.eps == layer.input_layernorm.eps
               and n.zero_centered == layer.input_layernorm.zero_centered for n in norms)


def _mlp_ok(layer) -> bool:
    m = layer.mlp
    return (type(m) is MLP and m.config.swiglu and _plain_linear(m.linear_fc1)
            and _plain_linear(m.linear_fc2) and _plain_norm(layer.pre_mlp_layernorm))


def _plan(layer: "TransformerLayer"):
    """``(attention block, MLP block or None)`` for this layer, or False when the fused kernels
    do not cover its attention."""
    a = layer.self_attention
    if not _attention_ok(layer, a):
        return False
    from ms_llm.ops.cpu_kernels.decode import steps as decode
    n = layer.input_layernorm
    attn = decode.AttentionBlock(
        n.weight, a.linear_qkv.weight, a.linear_qkv.bias,
        None if a.q_layernorm is None else a.q_layernorm.weight,
        None if a.k_layernorm is None else a.k_layernorm.weight,
        a.linear_proj.weight, a.linear_proj.bias, a.heads_per_group, a.gated, n.zero_centered,
        n.eps, 1.0 / math.sqrt(a.d))
    mlp = None
    if _mlp_ok(layer):
        m, n = layer.mlp, layer.pre_mlp_layernorm
        mlp = decode.MlpBlock(n.weight, m.linear_fc1.weight, m.linear_fc1.bias,
                              m.linear_fc2.weight, m.linear_fc2.bias, n.zero_centered, n.eps)
    return attn, mlp


def layer_step(layer: "TransformerLayer", x: Tensor, cos: Tensor, sin: Tensor,
               attention_mask: Optional[Tensor], kv_cache: "LayerKVCache") -> Optional[Tensor]:
    """The layer's output for one new token per row through the fused kernels, or None when
    this layer, input or cache is not one they cover (the caller then runs the modules).

    What the layer holds is inspected once per cache (``LayerKVCache.fused``): a cache belongs
    to one generation (or one chat) of one model."""
    if (x.shape[1] != 1 or type(kv_cache) is not LayerKVCache or kv_cache.k is None
            or attention_mask is None or layer.training or not enabled()):
        return None
    plan = kv_cache.fused
    if plan is None:
        plan = kv_cache.fused = _plan(layer)
    if (plan is False or x.dtype != float32 or kv_cache.k.dtype != float32
            or kv_cache.length >= kv_cache.capacity
            or attention_mask.shape[-1] != kv_cache.capacity):
        return None
    attn, mlp = plan
    pos = kv_cache.length
    h = attn(x, cos, sin, kv_cache.k, kv_cache.v, attention_mask, pos)
    kv_cache.length = pos + 1
    if mlp is not None:
        return mlp(h)
    return h + layer.mlp(layer.pre_mlp_layernorm(h))


def model_step(model, cache: "KVCache", threads: Optional[int] = None, parallel_macs: int = 0):
    """The whole model's decode step as one C call (``decode.ModelStep``), or None when the model,
    or this cache, is not one it covers: every layer a plain attention layer with a dense SwiGLU
    MLP (fp32, the same head shape and norms throughout), a plain embedding and LM head (no
    tensor parallel, LoRA or vocabulary-parallel logits), RoPE, a filled ``LayerKVCache`` per
    layer. The caller then runs the model (whose layers may still take ``layer_step``).
    ``threads`` (default: ``blas.default_blas_threads()``, the cores per worker) split the large
    products and the attention over long caches; ``parallel_macs`` > 0 lowers the work from
    which they do (tests force the threaded code on small models).

    Why one call: after ``layer_step`` a small model's token still paid ~15 MindSpore dispatches,
    a mask, cos / sin tensors, the LM head on one thread and a logits copy (issue #31)."""
    if (model.training or not _STATE.get("model_step", True) or not enabled()
            or model.config.position_embedding_type not in ("rope", "yarn")):
        return None
    layers = list(model.decoder.layers)
    head = model.plain_head_weight()
    emb = model.embedding.word_embeddings
    final = model.decoder.final_layernorm
    if (not layers or len(layers) != len(cache) or head is None or head.dtype != float32
            or not isinstance(emb, nn.Embedding) or emb.weight.dtype != float32
            or not _plain_norm(final) or head.shape[0] != emb.weight.shape[0]):
        return None
    first = layers[0]
    a0, n0 = first.self_attention, first.input_layernorm
    dims = None
    weights = []
    for layer, kv in zip(layers, cache.layers):
        if (type(kv) is not LayerKVCache or kv.k is None or kv.k.dtype != float32
                or not _attention_ok(layer, layer.self_attention) or not _mlp_ok(layer)):
            return None
        a, m, n = layer.self_attention, layer.mlp, layer.input_layernorm
        rq = 2 * a.heads_per_group if a.gated else a.heads_per_group
        d = a.d
        g = a.linear_qkv.weight.shape[0] // ((rq + 2) * d)
        here = dict(hidden=n.weight.shape[0], r=a.heads_per_group, g=g, d=d,
                    ffn=m.linear_fc1.weight.shape[0] // 2, gated=a.gated,
                    zero_centered=n.zero_centered, eps=n.eps,
                    qk_norm=a.q_layernorm is not None)
        if dims is None:
            dims = here
        if (here != dims or layer.pre_mlp_layernorm.eps != n0.eps
                or layer.pre_mlp_layernorm.zero_centered != n0.zero_centered
                or tuple(kv.k.shape[1:2] + kv.k.shape[3:]) != (g, d)):
            return None
        weights.append((n.weight, a.linear_qkv.weight, a.linear_qkv.bias,
                        None if a.q_layernorm is None else a.q_layernorm.weight,
                        None if a.k_layernorm is None else a.k_layernorm.weight,
                        a.linear_proj.weight, a.linear_proj.bias, layer.pre_mlp_layernorm.weight,
                        m.linear_fc1.weight, m.linear_fc1.bias, m.linear_fc2.weight,
                        m.linear_fc2.bias))
    if final.eps != n0.eps or final.zero_centered != n0.zero_centered:
        return None
    dims["rot"] = int(model.rope_table(1)[0].shape[-1])
    if dims["rot"] > dims["d"] or dims["rot"] % 2 or dims["rot"] > 1024:
        return None
    from ms_llm.ops.cpu_kernels.gemm import blas
    from ms_llm.ops.cpu_kernels.decode import steps as decode
    return decode.ModelStep(weights, emb.weight, final.weight, head, model.rope_table, dims,
                            n0.eps, 1.0 / math.sqrt(a0.d),
                            blas.default_blas_threads() if threads is None else threads,
                            parallel_macs)
