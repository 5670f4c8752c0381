"""The fused CPU MoE kernels (``ms_llm/ops/cpu_kernels/model/blas_moe.cpp``) against a NumPy reference
written here and against the composed ops they replace: values and gradients of the sort, the row
permutation, the SwiGLU expert FFN (both weight layouts, per-expert and stacked weights, experts
without tokens) and the weighted combine, then a whole MoE layer (fused vs ``composed_only``).

Tolerances: fp32 kernels against a float64 NumPy reference, relative to the largest magnitude of
each compared array: 2e-5 (sums of <= 2F = 32 products and k = 3 rows; fp32 rounding, different
summation order in OpenBLAS). Fused vs composed in fp32: same products, different order: 2e-5."""
from __future__ import annotations

import numpy as np
import pytest
import mindspore as ms
from mindspore import Parameter, Tensor

from ms_llm.compat import manual_seed
from ms_llm.models import TransformerConfig
from ms_llm.models import moe
from ms_llm.ops import moe as moe_ops

pytestmark = pytest.mark.skipif(not moe_ops.fused_available(),
                                reason="the fused MoE kernels need the CPU BLAS kernel library")

T, K, E, H, F = 10, 3, 6, 8, 5


def _close(got, ref, what, tol=2e-5):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, what
    np.testing.assert_allclose(got, ref, atol=tol * max(1.0, np.abs(ref).max()), rtol=0,
                               err_msg=what)


def _silu(g):
    return g / (1 + np.exp(-g))


def _np_layer(x, top, probs, w1, w2, dy):
    """Reference forward and backward in float64 (Linear layout: w1 [E, 2F, H], w2 [E, H, F])."""
    x, probs, w1, w2, dy = (a.astype(np.float64) for a in (x, probs, w1, w2, dy))
    out = np.zeros_like(x)
    dx, dp = np.zeros_like(x), np.zeros_like(probs)
    dw1, dw2 = np.zeros_like(w1), np.zeros_like(w2)
    for t in range(x.shape[0]):
        for j in range(top.shape[1]):
            e = top[t, j]
            h = w1[e] @ x[t]
            g, u = h[:F], h[F:]
            s = 1 / (1 + np.exp(-g))
            a = _silu(g) * u
            y = w2[e] @ a
            out[t] += probs[t, j] * y
            dp[t, j] = dy[t] @ y
            d_y = probs[t, j] * dy[t]
            dw2[e] += np.outer(d_y, a)
            d_a = w2[e].T @ d_y
            dh = np.concatenate([d_a * u * (s + g * s * (1 - s)), d_a * _silu(g)])
            dw1[e] += np.outer(dh, x[t])
            dx[t] += w1[e].T @ dh
    return out, dx, dp, dw1, dw2


def _routing(rng):
    top = np.stack([rng.choice(E - 2, K, replace=False) for _ in range(T)]).astype(np.int32)
    return top   # experts E-2 and E-1 receive no token


def test_sort_and_permute_match_numpy():
    rng = np.random.default_rng(0)
    top = _routing(rng)
    slots, restore, counts = moe_ops.sort_by_expert_device(Tensor(top), E)
    np.testing.assert_array_equal(slots.asnumpy(), np.argsort(top.ravel(), kind="stable"))
    np.testing.assert_array_equal(restore.asnumpy()[slots.asnumpy()], np.arange(T * K))
    np.testing.assert_array_equal(counts.asnumpy(), np.bincount(top.ravel(), minlength=E))
    assert counts.dtype == ms.int32
    # the host-list form (used by the expert-parallel dispatchers) is the same sort
    s2, r2, c2 = moe_ops.sort_by_expert(Tensor(top), E)
    np.testing.assert_array_equal(s2.asnumpy(), slots.asnumpy())
    assert c2 == np.bincount(top.ravel(), minlength=E).tolist()
    with moe_ops.composed_only():
        s3, r3, c3 = moe_ops.sort_by_expert(Tensor(top), E)
    np.testing.assert_array_equal(s3.asnumpy(), slots.asnumpy())
    np.testing.assert_array_equal(r3.asnumpy(), restore.asnumpy())

    x = rng.standard_normal((T, H)).astype(np.float32)
    d = rng.standard_normal((T * K, H)).astype(np.float32)
    order = np.argsort(top.ravel(), kind="stable")
    _, dx = ms.value_and_grad(
        lambda a: (moe_ops.permute_rows(a, slots, restore) * Tensor(d)).sum(), 0)(Tensor(x))
    fwd = moe_ops.permute_rows(Tensor(x), slots, restore).asnumpy()
    np.testing.assert_array_equal(fwd, x[order // K])
    ref_dx = np.zeros((T, H))
    np.add.at(ref_dx, order // K, d.astype(np.float64))
    _close(dx.asnumpy(), ref_dx, "permute dx")


@pytest.mark.parametrize("layout", ["linear", "linear_stacked", "grouped"])
def test_fused_layer_math_matches_numpy(layout):
    """sort -> permute -> expert FFN -> combine, forward and all gradients, vs float64 NumPy."""
    rng = np.random.default_rng(1)
    top = _routing(rng)
    x = rng.standard_normal((T, H)).astype(np.float32)
    probs = rng.random((T, K)).astype(np.float32)
    w1 = (rng.standard_normal((E, 2 * F, H)) * 0.5).astype(np.float32)
    w2 = (rng.standard_normal((E, H, F)) * 0.5).astype(np.float32)
    dy = rng.standard_normal((T, H)).astype(np.float32)
    if layout == "linear":          # SequentialMLP: one Parameter per expert
        p1 = [Parameter(Tensor(w1[e]), name=f"w1_{e}") for e in range(E)]
        p2 = [Parameter(Tensor(w2[e]), name=f"w2_{e}") for e in range(E)]
        weights, tb = p1 + p2, True
    elif layout == "linear_stacked":
        p1, p2 = Parameter(Tensor(w1), name="w1"), Parameter(Tensor(w2), name="w2")
        weights, tb = [p1, p2], True
    else:                           # GroupedMLP: [E, H, 2F] / [E, F, H]
        p1 = Parameter(Tensor(np.ascontiguousarray(w1.transpose(0, 2, 1))), name="w1")
        p2 = Parameter(Tensor(np.ascontiguousarray(w2.transpose(0, 2, 1))), name="w2")
        weights, tb = [p1, p2], False

    def loss(inp, pr):
        slots, restore, counts = moe_ops.sort_by_expert_device(Tensor(top), E)
        rows = moe_ops.permute_rows(inp, slots, restore)
        y = moe_ops.expert_ffn(rows, p1, p2, counts, transpose_b=tb)
        return (moe_ops.unpermute(y, restore, pr) * Tensor(dy)).sum()

    val, ((gx, gp), gws) = ms.value_and_grad(loss, (0, 1), weights)(Tensor(x), Tensor(probs))
    out, dx, dp, dw1, dw2 = _np_layer(x, top, probs, w1, w2, dy)
    _close(float(val.asnumpy()), (out * dy).sum(), "loss")
    _close(gx.asnumpy(), dx, "dx")
    _close(gp.asnumpy(), dp, "dprobs")
    gws = [g.asnumpy() for g in gws]
    if layout == "linear":
        g1, g2 = np.stack(gws[:E]), np.stack(gws[E:])
    elif layout == "linear_stacked":
        g1, g2 = gws
    else:
        g1, g2 = gws[0].transpose(0, 2, 1), gws[1].transpose(0, 2, 1)
    _close(g1, dw1, "dW1")
    _close(g2, dw2, "dW2")
    assert not g1[E - 2:].any() and not g2[E - 2:].any(), "experts without tokens: zero grads"


@pytest.mark.parametrize("grouped", [False, True])
def test_moe_layer_fused_equals_composed(grouped):
    """A whole MoELayer (router, aux + z loss, dispatcher, experts) on the fused path equals the
    composed path it replaces: output, loss and every gradient."""
    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                            ffn_hidden_size=32, padded_vocab_size=64, mlp_type="moe",
                            num_moe_experts=8, moe_router_topk=3, moe_ffn_hidden_size=12,
                            moe_grouped_gemm=grouped, moe_aux_loss_coeff=0.01,
                            moe_z_loss_coeff=0.001)
    manual_seed(3)
    layer = moe.MoELayer(cfg)
    rng = np.random.default_rng(4)
    x = Tensor(rng.standard_normal((2, 5, 16)).astype(np.float32))
    dy = Tensor(rng.standard_normal((2, 5, 16)).astype(np.float32))
    params = layer.trainable_params()

    def loss(inp):
        return (layer(inp) * dy).sum() + layer.router.aux_loss
    grad = ms.value_and_grad(loss, 0, params)
    layer.experts.gmm_impl = "fused"
    v_new, (gx_new, gw_new) = grad(x)
    assert isinstance(layer.token_dispatcher.token_permutation(
        x.reshape(-1, 16), *layer.router(x.reshape(-1, 16)))[1], Tensor), \
        "the local dispatcher keeps the block sizes on the device"
    layer.experts.gmm_impl = "loop"
    with moe_ops.composed_only():
        v_old, (gx_old, gw_old) = grad(x)
    _close(float(v_new.asnumpy()), float(v_old.asnumpy()), "loss")
    _close(gx_new.asnumpy(), gx_old.asnumpy(), "dx")
    for p, a, b in zip(params, gw_new, gw_old):
        _close(a.asnumpy(), b.asnumpy(), p.name)


def test_fused_rejects_what_it_cannot_run():
    with pytest.raises(RuntimeError, match="gmm_impl 'fused' needs"):
        moe.use_fused_ffn("fused", Tensor(np.zeros((2, 2), np.float16)))
    assert not moe.use_fused_ffn("loop", Tensor(np.zeros((2, 2), np.float32)))
    with moe_ops.composed_only():
        assert not moe_ops.fused_available()
    assert moe_ops.fused_available()
