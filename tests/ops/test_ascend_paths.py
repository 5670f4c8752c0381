"""ms-llm's Ascend branches on a fake Ascend device (tests/helpers/fake_ascend.py): what each one
hands to the native kernel, the documented limits that send a call to the composed form instead,
and a tiny dense, MoE and zero-centred-norm bf16 model trained one step through the fakes."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from helpers.fake_ascend import fake_ascend
from ms_llm import ops as hot
from ms_llm.compat import bfloat16, float32, manual_seed
from ms_llm.models import GPTModel, TransformerConfig
from ms_llm.models.layers import RMSNorm
from ms_llm.ops import _dispatch, attention, moe, rope
from ms_llm.ops.rms_norm import rms_norm_composed


def _rand(shape, dtype=float32, seed=0):
    return Tensor(np.random.default_rng(seed).standard_normal(shape).astype(np.float32)).astype(dtype)


def test_gmm_takes_a_tensor_group_list_beyond_128_experts(monkeypatch):
    calls, _ = fake_ascend(monkeypatch)
    e, k, m = 160, 8, 4                       # more local experts than a list may hold
    sizes = [1 if i % 3 else 0 for i in range(e)]
    x, w = _rand((sum(sizes), k)), _rand((e, m, k), seed=1)
    out = moe.grouped_matmul(x, w, sizes, transpose_b=True)
    ref = moe.grouped_matmul(x, w, sizes, transpose_b=True, impl="loop")
    np.testing.assert_allclose(out.asnumpy(), ref.asnumpy(), rtol=1e-5, atol=1e-6)
    assert calls["gmm"] == [((sum(sizes), k), (e, k, m))]
    with pytest.raises(ValueError, match="1025 local experts"):
        moe.grouped_matmul(_rand((1025, k)), _rand((1025, k, m)), [1] * 1025)


def test_rms_norm_hands_gamma_of_the_input_dtype(monkeypatch):
    """Zero-centred RMSNorm of a bf16 model: gamma ``1 + w`` is built in fp32, the kernel must
    get it as bf16 (the fake asserts equal dtypes)."""
    calls, _ = fake_ascend(monkeypatch)
    norm = RMSNorm(16, 1e-6, "bfloat16", zero_centered=True)
    x = _rand((2, 3, 16), bfloat16)
    out = norm(x)
    assert out.dtype == bfloat16 and calls["rms_norm"] == [((2, 3, 16), bfloat16)]
    ref = rms_norm_composed(x, Tensor(np.ones(16, np.float32)))
    np.testing.assert_allclose(out.astype(float32).asnumpy(), ref.astype(float32).asnumpy(),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("shape,native", [((1, 4, 32, 64), True),     # prefill: B*N <= 8*S
                                          ((2, 8, 1, 64), False),     # decode: B*N > 8*S
                                          ((2, 8, 1, 6), True),       # D*2 bytes not 32-aligned
                                          ((1, 2, 4, 896), False)])   # D >= 896
def test_rope_takes_the_composed_form_where_the_kernel_is_not_callable(monkeypatch, caplog,
                                                                        shape, native):
    calls, _ = fake_ascend(monkeypatch)
    monkeypatch.setattr(_dispatch, "_NOTICED", set())
    x = _rand(shape, bfloat16)
    cos, sin = rope.rope_cos_sin(shape[2], shape[3], 10000.0)
    with caplog.at_level("WARNING", "ms_llm.ops"):
        out = rope.apply_rope(x, cos, sin)
    assert bool(calls["rotary_position_embedding"]) == native
    assert ("composed path instead of the Ascend kernel" in caplog.text) != native
    ref = rope.apply_rope_composed(x, cos, sin)
    np.testing.assert_allclose(out.astype(float32).asnumpy(), ref.astype(float32).asnumpy(),
                               rtol=2e-2, atol=2e-2)   # the kernel gets bf16 tables


@pytest.mark.parametrize("d,dtype,native", [(16, bfloat16, True), (24, bfloat16, False),
                                            (528, bfloat16, False), (16, float32, False)])
def test_flash_attention_limits_fall_back_with_one_notice(monkeypatch, caplog, d, dtype, native):
    calls, _ = fake_ascend(monkeypatch)
    monkeypatch.setattr(_dispatch, "_NOTICED", set())
    q, k, v = (_rand((1, h, 4, d), dtype, seed=h) for h in (4, 2, 2))
    with caplog.at_level("WARNING", "ms_llm.ops"):
        out = attention.causal_attention(q, k, v)
        attention.causal_attention(q, k, v)
    assert len(calls["flash_attention_score"]) == (2 if native else 0)
    notices = [r for r in caplog.records if "composed path" in r.getMessage()]
    assert len(notices) == (0 if native else 1)
    assert out.dtype == dtype
    ref = attention.causal_attention_composed(q, k, v, 1 / np.sqrt(d))
    np.testing.assert_allclose(out.astype(float32).asnumpy(), ref.astype(float32).asnumpy(),
                               rtol=2e-2, atol=2e-2)


MODELS = {
    "dense": dict(),
    "moe": dict(mlp_type="moe", num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                moe_grouped_gemm=True),
    "zero_centred": dict(layernorm_zero_centered_gamma=True),
}


def _train_one_step(cfg):
    manual_seed(0)
    model = GPTModel(cfg)
    params = model.trainable_params()
    ids = Tensor(np.random.default_rng(0).integers(0, 64, (2, 16)).astype(np.int32))

    def fn(x):
        return model(x, labels=x).astype(float32).mean()

    loss, grads = ms.value_and_grad(fn, None, params)(ids)
    for p, g in zip(params, grads):
        assert g.dtype == p.dtype and np.isfinite(g.astype(float32).asnumpy()).all(), p.name
        # the update in fp32, as the mixed-precision optimizer does (ms_llm.ops.cast)
        p.set_data(hot.cast(hot.cast(p, float32) - hot.cast(g, float32) * 0.01, p.dtype))
    return float(loss.asnumpy()), float(fn(ids).asnumpy())


def test_tiny_bf16_models_train_a_step_on_the_fake_device(monkeypatch):
    calls, paths = fake_ascend(monkeypatch)
    base = dict(num_layers=1, hidden_size=32, num_attention_heads=2, num_query_groups=1,
                kv_channels=16, ffn_hidden_size=64, padded_vocab_size=64, params_dtype="bfloat16")
    for name, extra in MODELS.items():
        before, after = _train_one_step(TransformerConfig(**base, **extra))
        assert np.isfinite(before) and after < before, (name, before, after)
    for kernel in ("flash_attention_score", "rms_norm", "swiglu", "rotary_position_embedding",
                   "gmm"):
        assert calls[kernel], kernel
    # every gmm call got bf16 operands, every norm a bf16 gamma (the fakes assert the dtypes)
    assert all(dt == bfloat16 for _, dt in calls["rms_norm"])
    assert paths.read == set(_dispatch.OPS)
