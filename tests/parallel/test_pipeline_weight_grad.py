"""Zero-bubble's split backward (``parallel.pipeline.weight_grad``) and the kept backward closure
(``compat.autograd.PendingVJP``), against NumPy in float64.

Tolerance rtol 1e-5 / atol 1e-6: fp32 GEMMs of length <= 8 against float64, plus tanh's CPU error
(~1e-6 relative, notes section 10)."""
import numpy as np
from mindspore import Tensor, ops

from ms_llm.compat import nn
from ms_llm.compat.autograd import PendingVJP
from ms_llm.ops.linear import Linear
from ms_llm.parallel.pipeline.weight_grad import (SplitWeightGradLinear, WeightGradStore,
                                                  split_weight_grads)

TOL = dict(rtol=1e-5, atol=1e-6)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Module()
        self.inner.fc1 = Linear(3, 4, bias=False)
        self.fc2 = Linear(4, 2, bias=True)

    def forward(self, x):
        return self.fc2(ops.tanh(self.inner.fc1(x)))


class _Chunk(nn.Module):
    def __init__(self):
        super().__init__()
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList([_Block()])

    def forward(self, x):
        return self.decoder.layers[0](x)


def _numpy_grads(chunk, x, dy):
    blk = chunk.decoder.layers[0]
    w1 = blk.inner.fc1.weight.asnumpy().astype(np.float64)
    w2 = blk.fc2.weight.asnumpy().astype(np.float64)
    h = np.tanh(x @ w1.T)
    dh = (dy @ w2) * (1 - h ** 2)
    return {"dx": dh @ w1, "w1": dh.T @ x, "w2": dy.T @ h, "b2": dy.sum(0)}


def test_split_linears_defer_weight_grads_to_w():
    chunk = _Chunk()
    names = sorted(p.name for p in chunk.trainable_params())
    store = WeightGradStore()
    assert split_weight_grads(chunk, store) == 2
    blk = chunk.decoder.layers[0]
    assert isinstance(blk.inner.fc1, SplitWeightGradLinear)
    assert sorted(p.name for p in chunk.trainable_params()) == names   # checkpoints unchanged
    params = chunk.trainable_params()
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((5, 3)) for _ in range(2)]
    dy = rng.standard_normal((5, 2))
    pend = [PendingVJP(chunk, Tensor(x.astype(np.float32)), params) for x in xs]
    for key in (1, 0):                                   # last in, first out
        with store.collecting(key):
            (gx,), gw = pend[key].backward(Tensor(dy.astype(np.float32)))
        ref = _numpy_grads(chunk, xs[key], dy)
        np.testing.assert_allclose(gx.asnumpy(), ref["dx"], **TOL)
        got = {p.name: g.asnumpy() for p, g in zip(params, gw)}
        w1, w2, b2 = blk.inner.fc1.weight.name, blk.fc2.weight.name, blk.fc2.bias.name
        assert not got[w1].any() and not got[w2].any()    # deferred to W
        np.testing.assert_allclose(got[b2], ref["b2"], **TOL)   # biases stay in B
        deferred = {w.name: WeightGradStore.weight_grad(x, d).asnumpy()
                    for w, x, d in store.pop(key)}
        np.testing.assert_allclose(deferred[w1], ref["w1"], **TOL)
        np.testing.assert_allclose(deferred[w2], ref["w2"], **TOL)
    assert not store.records
    # outside a split B (the store not collecting), the whole gradient comes at once
    (gx,), gw = PendingVJP(chunk, Tensor(xs[0].astype(np.float32)), params).backward(
        Tensor(dy.astype(np.float32)))
    got = {p.name: g.asnumpy() for p, g in zip(params, gw)}
    np.testing.assert_allclose(got[blk.inner.fc1.weight.name], _numpy_grads(chunk, xs[0], dy)["w1"],
                               **TOL)



class _LastChunk(nn.Module):
    """A last pipeline stage: no layers of its own here, then the output layer."""

    def __init__(self, untied: bool):
        super().__init__()
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList([])
        self.output_layer = Linear(3, 4, bias=False) if untied else None

    def forward(self, x):
        return self.output_layer(x)


def test_output_layer_weight_grad_is_deferred_too():
    """The last stage's hidden x vocabulary weight gradient is the largest of all: W runs it."""
    assert split_weight_grads(_LastChunk(untied=False), WeightGradStore()) == 0   # tied head
    chunk, store = _LastChunk(untied=True), WeightGradStore()
    name = chunk.output_layer.weight.name
    assert split_weight_grads(chunk, store) == 1
    assert isinstance(chunk.output_layer, SplitWeightGradLinear)
    assert chunk.output_layer.weight.name == name
    rng = np.random.default_rng(1)
    x, dy = rng.standard_normal((5, 3)), rng.standard_normal((5, 4))
    w = chunk.output_layer.weight.asnumpy().astype(np.float64)
    step = PendingVJP(chunk, Tensor(x.astype(np.float32)), chunk.trainable_params())
    with store.collecting(0):
        (gx,), (gw,) = step.backward(Tensor(dy.astype(np.float32)))
    np.testing.assert_allclose(gx.asnumpy(), dy @ w, **TOL)
    assert not gw.asnumpy().any()
    (weight, xs, dys), = store.pop(0)
    assert weight is chunk.output_layer.weight
    np.testing.assert_allclose(WeightGradStore.weight_grad(xs, dys).asnumpy(), dy.T @ x, **TOL)
