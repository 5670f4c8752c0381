"""``compat.autograd.DeferredVJP``: pending backwards in first-in first-out order.

The first test shows the MindSpore 2.10 behaviour the class works around (a pending
``mindspore.vjp`` can only run last-in first-out); it fails when a MindSpore upgrade lifts the
restriction, the cue to let ``DeferredVJP`` keep the vjp instead of re-running the forward."""
import numpy as np
import mindspore as ms
import pytest
from mindspore import Parameter, Tensor, ops

from ms_llm.compat.autograd import DeferredVJP

W = Parameter(Tensor(np.linspace(-1, 1, 12).reshape(3, 4).astype(np.float32)), name="w")


def fn(x):
    return ops.tanh(ops.matmul(x, W))


def _inputs():
    rng = np.random.default_rng(0)
    return [Tensor(rng.standard_normal((2, 3)).astype(np.float32)) for _ in range(2)]


def test_mindspore_runs_pending_vjps_last_in_first_out_only():
    pending = [ms.vjp(fn, x, weights=[W]) for x in _inputs()]
    with pytest.raises(RuntimeError, match="top cell"):
        pending[0][1](ops.ones_like(pending[0][0]))


def test_deferred_vjp_first_in_first_out_matches_numpy():
    xs = _inputs()
    steps = [DeferredVJP(fn, x, [W]) for x in xs]
    w = W.asnumpy().astype(np.float64)
    for step, x in zip(steps, xs):            # oldest first, as 1F1B's backwards run
        a = x.asnumpy().astype(np.float64)
        y = np.tanh(a @ w)
        np.testing.assert_allclose(step.output.asnumpy(), y, rtol=1e-6, atol=1e-6)
        dy = np.full(y.shape, 0.5)
        gx, gw = step.backward(Tensor(dy.astype(np.float32)))
        local = dy * (1 - y ** 2)
        # fp32 against float64: 1e-5 covers tanh's CPU error (~1e-6 relative) and rounding.
        np.testing.assert_allclose(gx[0].asnumpy(), local @ w.T, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(gw[0].asnumpy(), a.T @ local, rtol=1e-5, atol=1e-6)


def test_prepare_reruns_the_forward_before_the_gradient_arrives():
    """The pipeline re-runs a forward while it waits for the next stage's gradient: ``prepare``
    then ``backward`` gives the same gradients, and ``prepare`` twice runs the forward once."""
    xs = _inputs()
    calls = []

    def counted(x):
        calls.append(1)
        return fn(x)

    steps = [DeferredVJP(counted, x, [W]) for x in xs]
    w = W.asnumpy().astype(np.float64)
    for step, x in zip(steps, xs):
        step.prepare()
        step.prepare()
        a = x.asnumpy().astype(np.float64)
        y = np.tanh(a @ w)
        dy = np.full(y.shape, 0.25)
        gx, gw = step.backward(Tensor(dy.astype(np.float32)))
        local = dy * (1 - y ** 2)
        np.testing.assert_allclose(gx[0].asnumpy(), local @ w.T, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(gw[0].asnumpy(), a.T @ local, rtol=1e-5, atol=1e-6)
    assert len(calls) == 4      # two forwards and two re-runs
