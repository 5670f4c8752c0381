"""The whole-model fused decode step (``fused_decode.model_step``: one C call from token ids to
the next greedy tokens) against the module path (``fused_decode.set_enabled(False)``).

* Each step's logits equal the module path's within 1e-5 of the largest logit (fp32 sums in a
  different order, BLAS gemv against the composed ops: ~1e-6 relative observed, as
  tests/models/test_decode_fast.py), and the tokens it returns are the argmax of its logits, for the
  attention variants it covers (MHA, GQA with biases, QK-norm with MQA, output gate with
  zero-centred norms and partial rotary, an untied LM head), left-padded rows included, on one
  thread and on two threads with the threshold lowered so that every product, the LM head and
  the attention are split.
* generate: greedy and seeded sampling give the module path's tokens; ``vocab_size`` restricts
  the argmax; models it does not cover (MoE, Gated DeltaNet, MLA) get no step.
"""
from __future__ import annotations

import numpy as np
import pytest
from mindspore import Tensor

from ms_llm.compat import no_grad
from ms_llm.inference import KVCache, generate
from ms_llm.models import fused_decode
from helpers.decode_fixtures import V, VARIANTS, build, step_logits

COVERED = ["llama-mha", "qwen25-gqa-bias", "qwen3-mqa-qknorm", "gated-zero-centred-partial-rope",
           "untied"]
CASES = dict(VARIANTS, untied=dict(family="qwen3", untie_embeddings_and_output_weights=True))


def model_step_logits(model, prompts, mask, steps: int, **kw):
    """As ``step_logits`` (prefill, then fixed tokens), the steps through ``model_step``."""
    b, s = prompts.shape
    cache = KVCache.for_model(model, b, s + steps)
    cache.mark_padding(~mask)
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
    padded = not mask.all()
    out = []
    with no_grad():
        model(Tensor(prompts.astype(np.int32)), kv_cache=cache, logits_to_keep=1,
              position_ids=Tensor(pos.astype(np.int32)) if padded else None)
    step = fused_decode.model_step(model, cache, **kw)
    assert step is not None
    nxt = pos[:, -1] + 1
    for t in range(steps):
        cache.mark_padding(np.zeros((b, 1), bool))
        slot = cache.length
        logits, tokens = step([(c.k, c.v) for c in cache.layers], np.full(b, 7 * t + 3),
                              nxt + t, cache.padding, slot, V)
        for layer in cache.layers:
            layer.length = slot + 1
        np.testing.assert_array_equal(tokens, np.argmax(logits, -1))
        out.append(logits.copy())
    return np.stack(out, 1)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", COVERED)
def test_model_step_logits_equal_module_path(name, threads):
    kw = dict(CASES[name])
    model = build(kw.pop("family", "llama"), **kw)
    prompts = np.random.default_rng(1).integers(0, V, (3, 9))
    mask = np.ones(prompts.shape, bool)
    mask[1, :3] = False                                        # rows 1 and 2 are left-padded
    mask[2, :8] = False
    want, _ = step_logits(model, prompts, mask, 5, fused=False)
    got = model_step_logits(model, prompts, mask, 5, threads=threads, parallel_macs=1)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(1.0, np.abs(want).max()))


def test_generate_through_model_step_equals_module_path():
    model = build("qwen3", num_query_groups=1, seed=2)
    rng = np.random.default_rng(3)
    ragged = [rng.integers(0, V, n).tolist() for n in (4, 11, 7)]
    runs = {}
    for fused in (True, False):
        before = fused_decode.set_enabled(fused)
        try:
            runs[fused] = (generate(model, ragged, 12),
                           generate(model, ragged, 12, do_sample=True, temperature=0.7,
                                    top_k=20, seed=5),
                           generate(model, ragged, 6, vocab_size=V // 3))
        finally:
            fused_decode.set_enabled(before)
    for got, want in zip(runs[True], runs[False]):
        np.testing.assert_array_equal(got, want)
    assert (runs[True][2][:, -6:] < V // 3).all()


@pytest.mark.parametrize("over", [dict(VARIANTS["moe"]), dict(VARIANTS["qwen3-next-hybrid"]),
                                  dict(family="llama", multi_latent_attention=True,
                                       q_lora_rank=None, kv_lora_rank=16, qk_head_dim=16,
                                       qk_pos_emb_head_dim=8, v_head_dim=16)])
def test_uncovered_models_get_no_model_step(over):
    model = build(over.pop("family", "llama"), **over)
    cache = KVCache.for_model(model, 1, 8)
    with no_grad():
        model(Tensor(np.arange(4, dtype=np.int32)[None]), kv_cache=cache, logits_to_keep=1)
    assert fused_decode.model_step(model, cache) is None
