"""Qwen3-Next against transformers' ``Qwen3NextForCausalLM`` (its torch chunked / recurrent
delta rule) on a tiny random checkpoint, with sequences longer than one 64-token chunk.

Tolerances (float32 on both sides): logits 1e-4 (values reach ~5; float32 rounding through four
64-wide layers and a 80-step recurrence measures ~1e-5, a wrong layout / gate / decay is O(0.1));
loss 1e-5 absolute and global grad norm 1e-5 relative (both are means over many tokens, so
rounding averages out)."""
from __future__ import annotations

import numpy as np
import pytest

import transformers  # noqa: F401  (test extra)

from helpers.hf_parity import loss_and_grad_norm
from ms_llm.models.registry import get_family
from helpers.paths import ROOT

SEQ = 80


def _build_hf(seed: int = 7):
    import torch
    spec = get_family("qwen3-next")
    cfg = transformers.AutoConfig.for_model(spec.hf_model_type, **spec.tiny_hf)
    model = transformers.Qwen3NextForCausalLM(cfg)
    model.config._attn_implementation = "eager"
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model.float()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import mindspore as ms  # noqa: F401
    from ms_llm.checkpoint import from_pretrained
    hf = _build_hf()
    root = tmp_path_factory.mktemp("qwen3_next")
    hf.save_pretrained(str(root / "hf"))
    return hf, from_pretrained(str(root / "hf")), root


def _ids(seed=3, b=2, s=SEQ):
    return np.random.default_rng(seed).integers(0, 96, size=(b, s)).astype(np.int64)


def test_logits_longer_than_a_chunk(pair):
    import mindspore as ms
    import torch
    hf, model, _ = pair
    ids = _ids()
    with torch.no_grad():
        want = hf.eval()(torch.tensor(ids)).logits.double().numpy()
    got = model(ms.Tensor(ids.astype(np.int32))).asnumpy().astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_loss_and_grad_norm(pair):
    hf, model, _ = pair
    got_loss, want_loss, got_norm, want_norm = loss_and_grad_norm(hf, model, _ids(seed=4))
    assert abs(got_loss - want_loss) < 1e-5
    assert abs(got_norm - want_norm) / want_norm < 1e-5, (got_norm, want_norm)
    params = model.trainable_params()
    n_hf = sum(p.numel() for p in hf.parameters())
    assert sum(int(np.prod(p.shape)) for p in params) == n_hf


def test_attention_mask_is_refused_with_one_line():
    from ms_llm.models.config import TransformerConfig
    from ms_llm.models.gated_delta_net import GatedDeltaNet
    import mindspore as ms
    c = TransformerConfig(num_layers=1, hidden_size=32, layer_types=["gated_delta_net"],
                          linear_key_head_dim=8, linear_value_head_dim=8,
                          linear_num_key_heads=2, linear_num_value_heads=4)
    x = ms.Tensor(np.zeros((1, 3, 32), np.float32))
    with pytest.raises(ValueError, match="not built for Gated DeltaNet"):
        GatedDeltaNet(c)(x, None, None, ms.Tensor(np.ones((1, 1, 3, 3), np.float32)))


def test_greedy_generation_cached_uncached_and_transformers(pair):
    """A 70-token prompt (the prefill crosses a chunk boundary) then 6 greedy tokens: with the
    cache (conv + recurrent state in DeltaNet layers, K/V in attention layers), without it,
    and transformers' ``generate`` give the same tokens; then a second prefill continuing the
    cache (a chat turn) equals one uncached pass over the whole text."""
    import mindspore as ms
    import torch
    from ms_llm.inference import generate
    from ms_llm.models.kv_cache import KVCache
    hf, model, _ = pair
    ids = _ids(seed=9, b=2, s=70)
    with torch.no_grad():
        want = hf.eval().generate(torch.tensor(ids), max_new_tokens=6, do_sample=False,
                                  min_new_tokens=6).numpy()
    cached = generate(model, ids, max_new_tokens=6)
    uncached = generate(model, ids, max_new_tokens=6, use_cache=False)
    np.testing.assert_array_equal(cached, uncached)
    np.testing.assert_array_equal(cached, want)

    cache = KVCache.for_model(model, 2, 90)
    model(ms.Tensor(ids[:, :50].astype(np.int32)), kv_cache=cache)
    got = model(ms.Tensor(ids[:, 50:].astype(np.int32)), kv_cache=cache).asnumpy()
    full = model(ms.Tensor(ids.astype(np.int32))).asnumpy()[:, 50:]
    np.testing.assert_allclose(got, full, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="cannot be rewound"):
        cache.crop(30)
    cache.crop(0)
    assert cache.length == 0


def test_left_padded_prompts_are_refused(pair):
    from ms_llm.inference import generate
    _, model, _ = pair
    with pytest.raises(ValueError, match="left-padded prompts are not built"):
        generate(model, [[1, 2, 3, 4], [5, 6]], max_new_tokens=2)


def test_published_config_matches_transformers_config_class():
    """configs/qwen3_next_80b_a3b.yaml written as HF config.json is accepted by transformers'
    Qwen3NextConfig and carries the published Qwen3-Next-80B-A3B values; reading it back gives
    the same model config."""
    import os
    from ms_llm.config import load_config
    from ms_llm.models.families import config_from_hf
    c = load_config(os.path.join(ROOT, "configs", "qwen3_next_80b_a3b.yaml")).model
    hf = get_family("qwen3-next").to_hf(c)
    cls = transformers.Qwen3NextConfig(**{k: v for k, v in hf.items()
                                          if k not in ("architectures", "torch_dtype")})
    published = dict(hidden_size=2048, intermediate_size=5120, num_hidden_layers=48,
                     num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                     vocab_size=151936, linear_num_key_heads=16, linear_num_value_heads=32,
                     linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                     num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                     shared_expert_intermediate_size=512, max_position_embeddings=262144,
                     norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False)
    assert {k: getattr(cls, k) for k in published} == published
    assert cls.rope_parameters["rope_theta"] == 1e7
    assert cls.rope_parameters["partial_rotary_factor"] == 0.25
    assert cls.layer_types == [
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)]
    back = config_from_hf(cls.to_dict())
    assert back.replace(moe_layer_pattern=None) == c and back.moe_layer_pattern == [1] * 48
