"""The fused one-token decode step (``ms_llm.models.fused_decode``) against the module path.

* Every decode step's logits with the fused kernels equal the module path's (the same model and
  cache, ``fused_decode.set_enabled(False)``) within 1e-5 of the largest logit (fp32; the two sum
  in different orders, BLAS gemv against the composed ops: ~1e-6 relative observed), for the
  attention variants the kernels cover: MHA, GQA with QKV bias and biased projections, QK-norm
  with MQA, the Qwen3-Next output gate with zero-centred norms and partial rotary (also next to
  a Gated DeltaNet layer, which keeps its own recurrent cache), a MoE layer (fused attention,
  module MLP), left-padded rows (per-row positions and padding slots).
* Greedy generation with the fused cache equals recomputing the whole sequence without a cache
  (the old uncached forward), token for token, batch 1 and a padded batch.
* Layers the fused blocks do not cover (MLA) keep the module path; their attention over the
  cache (``ops.cache_attention``, one kernel call) equals the softmax chain it replaced and a
  float64 NumPy reference.
"""
from __future__ import annotations

import numpy as np
import pytest
from mindspore import Tensor

from helpers.decode_fixtures import V, VARIANTS, build, step_logits
from ms_llm.compat import setup_device
from ms_llm.inference import generate


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_fused_step_logits_equal_module_path(name):
    kw = dict(VARIANTS[name])
    model = build(kw.pop("family", "llama"), **kw)
    rng = np.random.default_rng(1)
    prompts = rng.integers(0, V, (2, 9))
    mask = np.ones(prompts.shape, bool)
    if "layer_types" not in kw:     # Gated DeltaNet: padding is not built
        mask[1, :3] = False                                # row 1 is left-padded
    want, _ = step_logits(model, prompts, mask, 5, fused=False)
    got, cache = step_logits(model, prompts, mask, 5, fused=True)
    attention = [layer for layer in cache.layers if type(layer).__name__ == "LayerKVCache"]
    assert attention and all(layer.fused not in (None, False) for layer in attention)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(1.0, np.abs(want).max()))


def test_greedy_equals_uncached_forward():
    model = build("qwen3", num_query_groups=1, seed=2)
    rng = np.random.default_rng(3)
    one = rng.integers(0, V, (1, 12))
    np.testing.assert_array_equal(generate(model, one, 16), generate(model, one, 16,
                                                                      use_cache=False))
    ragged = [rng.integers(0, V, n).tolist() for n in (4, 11, 7)]
    np.testing.assert_array_equal(generate(model, ragged, 10),
                                  generate(model, ragged, 10, use_cache=False))


def test_uncovered_layers_keep_the_module_path():
    model = build("llama", multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=16,
                  qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16)
    prompts = np.random.default_rng(4).integers(0, V, (1, 5))
    mask = np.ones(prompts.shape, bool)
    want, _ = step_logits(model, prompts, mask, 3, fused=False)
    got, cache = step_logits(model, prompts, mask, 3, fused=True)
    assert all(layer.fused is False for layer in cache.layers)
    # their attention over the cache is the one-call kernel against the softmax chain
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(1.0, np.abs(want).max()))


def test_cache_attention_kernel_equals_numpy():
    """``ops.cache_attention`` (the one-call kernel) against float64 NumPy softmax attention:
    3 queries continuing a cache of 10 filled slots out of 16, per-row padding, GQA r = 2."""
    from ms_llm.ops import cache_attention
    setup_device("CPU")
    rng = np.random.default_rng(5)
    b, ng, r, s, cap, d, filled = 2, 2, 2, 3, 16, 8, 10
    q = rng.standard_normal((b, ng * r, s, d)).astype(np.float32)
    k, v = (rng.standard_normal((b, ng, cap, d)).astype(np.float32) for _ in range(2))
    hidden = np.arange(cap)[None, :] > np.arange(filled - s, filled)[:, None]       # [s, cap]
    mask = np.broadcast_to(hidden, (b, s, cap)).copy()
    mask[1, :, :4] = True                                                        # padding
    got = cache_attention(Tensor(q), Tensor(k), Tensor(v), Tensor(mask[:, None]), 0.3).asnumpy()
    kk, vv = (np.repeat(x.astype(np.float64), r, axis=1) for x in (k, v))
    scores = 0.3 * q.astype(np.float64) @ kk.swapaxes(-1, -2)
    scores = np.where(mask[:, None], -np.inf, scores)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ vv
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
