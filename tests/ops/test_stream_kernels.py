"""The bf16 residual stream's CPU kernels (``ms_llm.ops.stream``: residual add, embedding, split)
against NumPy written here: exact, since both sides round the same fp32 numbers once."""
import ml_dtypes
import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from ms_llm.compat import setup_device

setup_device("CPU")
from ms_llm.ops import cpu_kernels  # noqa: E402
from ms_llm.ops.stream import embedding, residual_add, split_last  # noqa: E402

BF16 = ml_dtypes.bfloat16
pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="C++ kernels not built")


def _ms(a, dtype):
    return Tensor(np.asarray(a, np.float32)).astype(dtype)


def _np(t):
    return t.astype(ms.float32).asnumpy()


@pytest.mark.parametrize("dtype", [ms.bfloat16, ms.float32])
def test_residual_add_rounds_once_and_passes_the_gradient_to_both(dtype):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 33, 64)) * 3, rng.standard_normal((2, 33, 64))
    if dtype == ms.bfloat16:
        a, b = a.astype(BF16).astype(np.float32), b.astype(BF16).astype(np.float32)
    want = (a.astype(np.float32) + b.astype(np.float32))
    if dtype == ms.bfloat16:
        want = want.astype(BF16).astype(np.float32)
    ta, tb = _ms(a, dtype), _ms(b, dtype)
    got = residual_add(ta, tb)
    assert got.dtype == dtype
    np.testing.assert_array_equal(_np(got), want)
    dout = rng.standard_normal(a.shape).astype(np.float32)
    w = _ms(dout, dtype).astype(ms.float32)     # bf16 has no CPU ReduceSum: the loss is fp32
    ga, gb = ms.grad(lambda x, y: (residual_add(x, y).astype(ms.float32) * w).sum(),
                     grad_position=(0, 1))(ta, tb)
    np.testing.assert_array_equal(_np(ga), _np(w))
    np.testing.assert_array_equal(_np(gb), _np(w))


@pytest.mark.parametrize("dtype", [ms.bfloat16, ms.float32])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_embedding_gathers_and_sums_repeated_ids_in_token_order(dtype, id_dtype):
    rng = np.random.default_rng(1)
    v, h = 50, 24
    table = rng.standard_normal((v, h)).astype(np.float32)
    ids = rng.integers(0, 12, (3, 40)).astype(id_dtype)      # many repeats, rows 12.. unused
    dy = rng.standard_normal((3, 40, h)).astype(np.float32)
    if dtype == ms.bfloat16:
        table, dy = table.astype(BF16).astype(np.float32), dy.astype(BF16).astype(np.float32)
    w, g = _ms(table, dtype), _ms(dy, ms.float32)
    out = embedding(Tensor(ids), w)
    assert out.dtype == dtype and out.shape == (3, 40, h)
    np.testing.assert_array_equal(_np(out), table[ids])
    want = np.zeros((v, h), np.float32)
    for i, r in enumerate(ids.reshape(-1)):                  # fp32 sums in token order
        want[r] += dy.reshape(-1, h)[i]
    if dtype == ms.bfloat16:
        want = want.astype(BF16).astype(np.float32)
    dw = ms.grad(lambda t: (embedding(Tensor(ids), t).astype(ms.float32) * g).sum())(w)
    assert dw.dtype == dtype
    np.testing.assert_array_equal(_np(dw), want)


def test_embedding_refuses_an_id_outside_the_table():
    w = _ms(np.ones((4, 8)), ms.bfloat16)
    with pytest.raises(RuntimeError):
        embedding(Tensor(np.array([1, 4], np.int32)), w).asnumpy()


@pytest.mark.parametrize("sections", [(32, 8, 8), (16, 16, 8, 8)])
def test_split_last_pieces_and_their_gradient_through_a_transpose(sections):
    """Pieces equal NumPy's; each piece's gradient lands in its own columns, also when the piece
    is transposed afterwards (the MindSpore 2.10 mint.split bug ``F.split`` works around), and a
    piece left unused gets zeros. Two sections tuples of one input shape in one process."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 5, 3, sum(sections))).astype(BF16).astype(np.float32)
    tx = _ms(x, ms.bfloat16)
    pieces = split_last(tx, sections)
    bounds = np.cumsum((0,) + sections)
    for p, a, b in zip(pieces, bounds[:-1], bounds[1:]):
        assert p.dtype == ms.bfloat16
        np.testing.assert_array_equal(_np(p), x[..., a:b])
    ws = [rng.standard_normal((2, 3, 5, s)).astype(np.float32) for s in sections]

    def loss(t):
        parts = split_last(t, sections)[:-1]      # the last piece unused
        return sum((q.swapaxes(1, 2).astype(ms.float32) * Tensor(w)).sum()
                   for q, w in zip(parts, ws))

    g = _np(ms.grad(loss)(tx))
    for w, a, b in zip(ws[:-1], bounds[:-2], bounds[1:-1]):
        want = w.swapaxes(1, 2).astype(BF16).astype(np.float32)
        np.testing.assert_array_equal(g[..., a:b], want)
    np.testing.assert_array_equal(g[..., bounds[-2]:], 0)


def test_cast_between_bf16_and_fp32_matches_numpy_both_ways_with_its_gradient():
    """Widening is exact; narrowing rounds to nearest even like ml_dtypes (ties, -0, inf, nan
    included); the gradient of each direction is the other."""
    from ms_llm.ops.stream import cast
    vals = np.array([1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -0.0, np.inf, -np.inf, np.nan,
                     3.14159, -2.5e-3, 1e30], np.float32)
    x = np.concatenate([vals, np.random.default_rng(3).standard_normal(1000).astype(np.float32)])
    t = Tensor(x)
    b = cast(t, ms.bfloat16)
    assert b.dtype == ms.bfloat16
    want = x.astype(BF16)
    got = b.asnumpy().astype(np.float32) if b.asnumpy().dtype != np.float32 else _np(b)
    np.testing.assert_array_equal(got.astype(BF16).view(np.uint16)[~np.isnan(x)],
                                  want.view(np.uint16)[~np.isnan(x)])
    assert np.isnan(_np(b)[np.isnan(x)]).all()
    back = cast(b, ms.float32)
    assert back.dtype == ms.float32
    np.testing.assert_array_equal(back.asnumpy()[~np.isnan(x)], want.astype(np.float32)[~np.isnan(x)])
    w = Tensor(np.random.default_rng(4).standard_normal(x.size).astype(np.float32))
    g = ms.grad(lambda a: (cast(cast(a, ms.float32), ms.bfloat16).astype(ms.float32) * w).sum())(b)
    assert g.dtype == ms.bfloat16
    np.testing.assert_array_equal(_np(g), w.asnumpy().astype(BF16).astype(np.float32))


def test_fork_gives_two_copies_whose_gradients_are_summed_once():
    """Both outputs equal x; the input's gradient is the two output gradients summed in fp32 and
    rounded once (NumPy: bf16(fp32(a) + fp32(b)))."""
    from ms_llm.ops.stream import fork
    rng = np.random.default_rng(5)
    x = _ms(rng.standard_normal((3, 7, 16)).astype(BF16).astype(np.float32), ms.bfloat16)
    a, b = fork(x)
    np.testing.assert_array_equal(_np(a), _np(x))
    np.testing.assert_array_equal(_np(b), _np(x))
    wa = rng.standard_normal((3, 7, 16)).astype(BF16).astype(np.float32)
    wb = rng.standard_normal((3, 7, 16)).astype(BF16).astype(np.float32)

    def loss(t):
        p, q = fork(t)
        return (p.astype(ms.float32) * Tensor(wa)).sum() + (q.astype(ms.float32) * Tensor(wb)).sum()

    g = ms.grad(loss)(x)
    assert g.dtype == ms.bfloat16
    np.testing.assert_array_equal(_np(g), (wa + wb).astype(BF16).astype(np.float32))


@pytest.mark.parametrize("pieces", [(4, 1, 1), (2, 2, 1, 1), (3,)])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_split_and_merge_heads_match_numpy_layouts(pieces, dtype):
    """``split_heads`` / ``merge_heads`` (C copies on CPU) against NumPy's reshape + transpose,
    values and gradients exact (pure data movement: no arithmetic)."""
    import mindspore as ms
    from ms_llm import ops as hot
    from ms_llm.ops.stream import _heads_kernel
    dt = ms.float32 if dtype == "fp32" else ms.bfloat16
    assert _heads_kernel(dt)                        # the kernel path, not the composed one
    b, s, g, d = 2, 5, 3, 4
    rng = np.random.default_rng(len(pieces))
    x = rng.standard_normal((b, s, g, sum(pieces) * d)).astype(np.float32)
    xt = Tensor(x).astype(dt)
    xr = xt.astype(ms.float32).asnumpy()             # the values bf16 holds
    outs = hot.split_heads(xt, pieces)
    off = 0
    weights = []
    for out, p in zip(outs, pieces):
        want = xr[..., off * d:(off + p) * d].reshape(b, s, g * p, d).transpose(0, 2, 1, 3)
        assert out.dtype == dt and out.shape == want.shape
        np.testing.assert_array_equal(out.astype(ms.float32).asnumpy(), want)
        weights.append(rng.standard_normal(want.shape).astype(np.float32))
        off += p

    def loss(t):
        return sum((o.astype(ms.float32) * Tensor(w)).sum()
                   for o, w in zip(hot.split_heads(t, pieces), weights))
    grad = ms.grad(loss)(xt).astype(ms.float32).asnumpy()
    want = np.concatenate([w.transpose(0, 2, 1, 3).reshape(b, s, g, -1) for w in weights], -1)
    np.testing.assert_array_equal(grad, Tensor(want).astype(dt).astype(ms.float32).asnumpy())

    o = rng.standard_normal((b, 6, s, d)).astype(np.float32)
    ot = Tensor(o).astype(dt)
    merged = hot.merge_heads(ot)
    np.testing.assert_array_equal(merged.astype(ms.float32).asnumpy(),
                                  ot.astype(ms.float32).asnumpy().transpose(0, 2, 1, 3)
                                  .reshape(b, s, 6 * d))
    w = rng.standard_normal((b, s, 6 * d)).astype(np.float32)
    go = ms.grad(lambda t: (hot.merge_heads(t).astype(ms.float32) * Tensor(w)).sum())(ot)
    np.testing.assert_array_equal(go.astype(ms.float32).asnumpy(),
                                  Tensor(w.reshape(b, s, 6, d).transpose(0, 2, 1, 3))
                                  .astype(dt).astype(ms.float32).asnumpy())


def test_widening_and_narrowing_casts_differentiate_together_under_jit():
    """Graph mode keys a Custom op's output type by its function and input shapes: both cast
    directions under one kernel name gave a bf16 step an fp32 gradient beside a bf16 one (an
    AddN type error in autograd). Each direction has its own name; the gradient is exact."""
    from ms_llm.ops.stream import cast
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(ml_dtypes.bfloat16)

    def f(a, b):
        wide_a, wide_b = cast(a, ms.float32) * 2, cast(b, ms.float32) * 3
        return (cast(wide_a, ms.bfloat16).astype(ms.float32) *
                cast(wide_b, ms.bfloat16).astype(ms.float32)).sum()

    ta, tb = (Tensor(v.astype(np.float32)).astype(ms.bfloat16) for v in x)
    ga, gb = ms.jit(ms.grad(f, grad_position=(0, 1)))(ta, tb)
    assert ga.dtype == gb.dtype == ms.bfloat16
    a, b = x.astype(np.float64)
    # d/da of (2a)(3b) = 6b, d/db = 6a: bf16 products of bf16 inputs, one rounding each
    for got, want in ((ga, 6 * b), (gb, 6 * a)):
        want = want.astype(ml_dtypes.bfloat16).astype(np.float64)
        np.testing.assert_allclose(got.astype(ms.float32).asnumpy(), want, rtol=1e-2)
