"""Gated delta rule: the chunked and recurrent forms against a sequential float64 NumPy
recurrence written here (values, and gradients by central differences of the NumPy recurrence).

Tolerances: float64 values agree to rounding (1e-10); the gradient check compares a directional
derivative with a central difference at step 1e-5 (truncation error ~1e-10, relative 1e-6 is
generous); float32 runs of the chunked form differ from float64 by accumulated rounding over
~50 steps (2e-5)."""
import numpy as np
import pytest
from mindspore import Tensor, ops
from mindspore.common import dtype as mstype

from ms_llm.models.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule


def numpy_rule(q, k, v, g, beta, state=None):
    b, s, h, dk = k.shape
    dv = v.shape[-1]
    S = np.zeros((b, h, dk, dv)) if state is None else state.copy()
    out = np.zeros((b, s, h, dv))
    for t in range(s):
        qt = q[:, t] / np.sqrt((q[:, t] ** 2).sum(-1, keepdims=True) + 1e-6) / np.sqrt(dk)
        kt = k[:, t] / np.sqrt((k[:, t] ** 2).sum(-1, keepdims=True) + 1e-6)
        S = S * np.exp(g[:, t])[..., None, None]
        pred = np.einsum("bhkv,bhk->bhv", S, kt)
        S = S + np.einsum("bhk,bhv->bhkv", kt, (v[:, t] - pred) * beta[:, t][..., None])
        out[:, t] = np.einsum("bhkv,bhk->bhv", S, qt)
    return out, S


def inputs(seed, b=2, s=37, h=3, dk=8, dv=6):
    r = np.random.default_rng(seed)
    return [r.standard_normal((b, s, h, dk)), r.standard_normal((b, s, h, dk)),
            r.standard_normal((b, s, h, dv)), -np.exp(r.standard_normal((b, s, h))) * 0.5,
            1 / (1 + np.exp(-r.standard_normal((b, s, h)))), r.standard_normal((b, h, dk, dv))]


def ms64(xs):
    return [Tensor(x, mstype.float64) for x in xs]


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_values_float64(form):
    *x, s0 = inputs(0)
    ref, ref_s = numpy_rule(*x, s0)
    if form == "chunk":
        out, st = chunk_gated_delta_rule(*ms64(x), chunk_size=8, initial_state=Tensor(s0))
    else:
        out, st = recurrent_gated_delta_rule(*ms64(x), initial_state=Tensor(s0))
    np.testing.assert_allclose(out.asnumpy(), ref, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(st.asnumpy(), ref_s, rtol=1e-10, atol=1e-10)


def test_chunk_float32_and_split_state():
    """float32 at the default chunk 64 over 2+ chunks; a sequence run in two calls through the
    state equals one call (the prefill-then-decode path)."""
    *x, s0 = inputs(1, s=80)
    ref, _ = numpy_rule(*x, s0)
    x32 = [Tensor(a.astype(np.float32)) for a in x]
    out, _ = chunk_gated_delta_rule(*x32, initial_state=Tensor(s0.astype(np.float32)))
    np.testing.assert_allclose(out.asnumpy(), ref, rtol=2e-5, atol=2e-5)
    xa = [Tensor(a[:, :50]) for a in x]
    xb = [Tensor(a[:, 50:]) for a in x]
    oa, sa = chunk_gated_delta_rule(*xa, chunk_size=16, initial_state=Tensor(s0))
    ob, _ = recurrent_gated_delta_rule(*xb, initial_state=sa)
    np.testing.assert_allclose(np.concatenate([oa.asnumpy(), ob.asnumpy()], 1), ref,
                               rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_gradients_float64(form):
    """d<out, w>/d(input) along random directions == central difference of the NumPy recurrence,
    for every input (q, k, v, g, beta, initial state)."""
    *x, s0 = inputs(2, b=1, s=21, h=2, dk=4, dv=3)
    allx = x + [s0]
    r = np.random.default_rng(5)
    wout = r.standard_normal((1, 21, 2, 3))

    def f_np(args):
        return float((numpy_rule(*args[:5], args[5])[0] * wout).sum())

    def f_ms(*args):
        if form == "chunk":
            out, _ = chunk_gated_delta_rule(*args[:5], chunk_size=8, initial_state=args[5])
        else:
            out, _ = recurrent_gated_delta_rule(*args[:5], initial_state=args[5])
        return (out * Tensor(wout)).sum()

    grads = ops.grad(f_ms, grad_position=tuple(range(6)))(*ms64(allx))
    eps = 1e-5
    for i, gr in enumerate(grads):
        d = r.standard_normal(allx[i].shape)
        plus = [a.copy() for a in allx]
        minus = [a.copy() for a in allx]
        plus[i] = plus[i] + eps * d
        minus[i] = minus[i] - eps * d
        fd = (f_np(plus) - f_np(minus)) / (2 * eps)
        np.testing.assert_allclose((gr.asnumpy() * d).sum(), fd, rtol=1e-6, atol=1e-8,
                                   err_msg=f"input {i}")


def test_segments_composed_through_their_affine_state_maps_float64():
    """Context parallel's form: a sequence cut into segments (lengths not multiples of the
    chunk), each run alone with an unknown initial state, then chained on the host with
    ``S_end = M S0 + B`` and ``out = out0 + P S0``, equals the sequential recurrence."""
    from ms_llm.models.gated_delta_rule import chunk_gated_delta_rule_segment
    *x, s0 = inputs(2, s=29)
    ref, ref_s = numpy_rule(*x, s0)
    state, outs = s0, []
    for lo, hi in ((0, 11), (11, 13), (13, 29)):
        seg = ms64([a[:, lo:hi] for a in x])
        out0, p, b, m = (t.asnumpy() for t in chunk_gated_delta_rule_segment(*seg, chunk_size=4))
        outs.append((out0 + p @ state).transpose(0, 2, 1, 3))
        state = m @ state + b
    np.testing.assert_allclose(np.concatenate(outs, 1), ref, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(state, ref_s, rtol=1e-10, atol=1e-10)
