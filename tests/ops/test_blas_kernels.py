"""OpenBLAS-backed AOT kernels (ms_llm.ops.cpu_kernels.linear / bmm, library built from blas_kernels.cpp
and linked against the scipy-openblas32 package): build/availability, and forward plus every gradient
against float64 NumPy, in PyNative and under mindspore.jit (a Cell whose weights get value_and_grad).

Skipped when scipy_openblas32 is not installed or there is no C++ compiler.

Tolerance: fp32 GEMM with K-term dot products. The standard error bound is
|fl(A B) - A B| <= gamma_K |A| |B| elementwise (gamma_K ~ K * 1.2e-7 worst case, ~sqrt(K) * 1.2e-7
typical), so every result is checked as |got - ref| <= 1e-5 * (|A| |B|) + 1e-6, with |A| |B| computed in
float64 from the same operands as the reference. For the bias grad (column sums of dY, accumulated in
double) |A| |B| is the column sum of |dY|. Measured: at most 3% of the tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("scipy_openblas32", reason="scipy-openblas32 (the BLAS of the BLAS kernels) is not installed")

import mindspore as ms  # noqa: E402
from mindspore import Parameter, Tensor, nn  # noqa: E402

ms.set_device("CPU")
ms.set_context(pynative_synchronize=True)

from ms_llm.ops import cpu_kernels as ck  # noqa: E402
from ms_llm.ops.cpu_kernels import build  # noqa: E402
from ms_llm.ops.cpu_kernels.gemm import blas  # noqa: E402

pytestmark = pytest.mark.skipif(build._compiler() is None, reason="no C++ compiler on this machine")

RTOL_GEMM = 1e-5
ATOL = 1e-6
MODES = ["pynative", "jit"]


def _t(a):
    return Tensor(np.ascontiguousarray(a))


def _check(got, ref, bound):
    """|got - ref| <= RTOL_GEMM * bound + ATOL elementwise (bound = |A| |B| of the product)."""
    got = np.asarray(got, np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    err = np.abs(got - ref)
    tol = RTOL_GEMM * bound + ATOL
    worst = float((err / tol).max()) if err.size else 0.0
    assert worst <= 1.0, f"max error {err.max():.3e} is {worst:.2f}x the tolerance"


@pytest.fixture(scope="module")
def blas_ok():
    if build._disabled():
        pytest.skip("MS_LLM_DISABLE_AOT is set")
    if not ck.blas_available():
        pytest.fail(f"BLAS kernels should build here (g++ and scipy-openblas32 present): {ck.blas_reason()}")
    return ck


# ---------------------------------------------------------------------------------------------------
# build / availability


def test_separate_library(blas_ok):
    path = ck.blas_library_path()
    assert path is not None and path.is_file() and path.name == build.BLAS_LIB_NAME
    assert path.parent.parent == build.cache_root()
    assert all(not s.name.startswith("blas_") for s in build.sources())  # main library does not need BLAS
    names = sorted(s.name for s in build.blas_sources())
    # every blas_* source of the kernels' domain folders (a new kernel file joins by its name) and
    # the shared math
    folder = sorted(p.name for p in build._SRC_DIR.rglob("blas_*")
                    if p.suffix in (".cpp", ".h"))
    assert names == sorted(folder + ["cpu_math.h"])
    assert {"blas_kernels.cpp", "blas_attention.cpp", "blas_decode.cpp", "blas_moe.cpp",
            "blas_muon.cpp"} <= set(names)
    assert not any(n.startswith("dnnl_") for n in names)      # oneDNN builds its own library
    if ck.available():
        assert ck.library_path() != path


def test_threads(blas_ok):
    # import mindspore setenv()s OMP_NUM_THREADS=1, which OpenBLAS would honour: the wrapper sets it explicitly
    n = blas.default_blas_threads()
    assert ck.blas_threads() == n
    try:
        ck.set_blas_threads(1)
        assert ck.blas_threads() == 1
    finally:
        ck.set_blas_threads(n)
    assert ck.blas_threads() == n


def test_unavailable_without_openblas(monkeypatch, caplog):
    """scipy-openblas32 missing: blas_available() False with the reason logged once, the main kernels
    still available, linear/bmm run MindSpore's matmuls."""
    main_ok = ck.available()

    def missing():
        raise RuntimeError("scipy-openblas32 is not installed (pip install scipy-openblas32): simulated")

    try:
        build._BLAS.reset()
        monkeypatch.setattr(build, "openblas_info", missing)
        with caplog.at_level("WARNING", logger="ms_llm.ops.cpu_kernels"):
            assert not ck.blas_available()
            assert not ck.blas_available()
        assert "scipy-openblas32 is not installed" in ck.blas_reason()
        assert sum("BLAS kernels unavailable" in r.getMessage() for r in caplog.records) == 1
        assert ck.available() == main_ok
        rng = np.random.default_rng(0)
        x, w, b = rng.standard_normal((3, 8)), rng.standard_normal((5, 8)), rng.standard_normal(5)
        y = ck.linear(_t(x.astype(np.float32)), _t(w.astype(np.float32)), _t(b.astype(np.float32))).asnumpy()
        _check(y, x @ w.T + b, np.abs(x) @ np.abs(w).T + np.abs(b))
        c = ck.bmm(_t(x.astype(np.float32)[None]), _t(w.astype(np.float32)[None]), transpose_b=True).asnumpy()
        _check(c, (x @ w.T)[None], (np.abs(x) @ np.abs(w).T)[None])
    finally:
        monkeypatch.undo()
        build._BLAS.reset()
    assert ck.blas_available()


# ---------------------------------------------------------------------------------------------------
# linear


class _Linear(nn.Cell):
    def __init__(self, w, b):
        super().__init__()
        self.weight = Parameter(_t(w), name="weight")
        self.bias = None if b is None else Parameter(_t(b), name="bias")

    def construct(self, x):
        return ck.linear(x, self.weight, self.bias)


def _linear_run(x, w, b, g, mode):
    """Forward, and grads of sum(y * g) for x (grad_position) and the Cell's weights (value_and_grad)."""
    net = _Linear(w, b)
    gt = _t(g)

    def loss_fn(inp):
        return (net(inp) * gt).sum()

    vg = ms.value_and_grad(loss_fn, grad_position=0, weights=net.trainable_params())
    fwd = net
    if mode == "jit":
        vg = ms.jit(vg)
        fwd = ms.jit(net.construct)
    y = fwd(_t(x)).asnumpy()
    loss, (dx, wgrads) = vg(_t(x))
    return y, float(loss.asnumpy()), dx.asnumpy(), [p.asnumpy() for p in wgrads]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(
    "xshape,n",
    [((7, 96), 257), ((2, 5, 96), 257), ((3, 4, 2, 33), 17), ((64, 512), 768)],
    ids=["2d", "3d", "4d-odd", "model"],
)
def test_linear(blas_ok, mode, bias, xshape, n):
    rng = np.random.default_rng(sum(xshape) + n + bias)
    k = xshape[-1]
    x = rng.standard_normal(xshape).astype(np.float32)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    g = rng.standard_normal(xshape[:-1] + (n,)).astype(np.float32)

    y, loss, dx, wgrads = _linear_run(x, w, b, g, mode)

    x64, w64, g64 = x.astype(np.float64), w.astype(np.float64), g.astype(np.float64)
    ax, aw, ag = np.abs(x64), np.abs(w64), np.abs(g64)
    ref_y = x64 @ w64.T + (0.0 if b is None else b.astype(np.float64))
    bound_y = ax @ aw.T + (0.0 if b is None else np.abs(b.astype(np.float64)))
    _check(y, ref_y, bound_y)
    assert loss == pytest.approx(float((ref_y * g64).sum()), rel=1e-4, abs=1e-3)
    _check(dx, g64 @ w64, ag @ aw)
    g2, x2 = g64.reshape(-1, n), x64.reshape(-1, k)
    _check(wgrads[0], g2.T @ x2, np.abs(g2).T @ np.abs(x2))
    if bias:
        assert len(wgrads) == 2
        _check(wgrads[1], g2.sum(0), np.abs(g2).sum(0))
    else:
        assert len(wgrads) == 1


def test_linear_fp16_and_errors(blas_ok):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 32)).astype(np.float16)
    w = rng.standard_normal((9, 32)).astype(np.float16)
    y = ck.linear(_t(x), _t(w))
    assert y.dtype == ms.float16
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(y.asnumpy().astype(np.float64), ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max())
    with pytest.raises((RuntimeError, ValueError)):  # K mismatch: the kernel returns an error code
        ck.linear(_t(np.ones((4, 32), np.float32)), _t(np.ones((9, 31), np.float32))).asnumpy()


# ---------------------------------------------------------------------------------------------------
# bmm


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False), (True, True)])
def test_bmm(blas_ok, mode, ta, tb):
    rng = np.random.default_rng(10 + 2 * ta + tb)
    lead, m, k, n = (2, 3), 33, 17, 20
    a = rng.standard_normal(lead + ((k, m) if ta else (m, k))).astype(np.float32)
    b = rng.standard_normal(lead + ((n, k) if tb else (k, n))).astype(np.float32)
    g = rng.standard_normal(lead + (m, n)).astype(np.float32)
    gt = _t(g)

    def fwd(p, q):
        return ck.bmm(p, q, ta, tb)

    def loss(p, q):
        return (ck.bmm(p, q, ta, tb) * gt).sum()

    grad = ms.grad(loss, (0, 1))
    if mode == "jit":
        fwd, grad = ms.jit(fwd), ms.jit(grad)
    c = fwd(_t(a), _t(b)).asnumpy()
    da, db = (t.asnumpy() for t in grad(_t(a), _t(b)))

    def op(v, t):
        return v.swapaxes(-1, -2) if t else v

    a64, b64, g64 = a.astype(np.float64), b.astype(np.float64), g.astype(np.float64)
    A, B = op(a64, ta), op(b64, tb)
    _check(c, A @ B, np.abs(A) @ np.abs(B))
    rda, rdb = g64 @ B.swapaxes(-1, -2), A.swapaxes(-1, -2) @ g64  # grads of op(a), op(b)
    bda = np.abs(g64) @ np.abs(B).swapaxes(-1, -2)
    bdb = np.abs(A).swapaxes(-1, -2) @ np.abs(g64)
    _check(da, op(rda, ta), op(bda, ta))
    _check(db, op(rdb, tb), op(bdb, tb))


# ---------------------------------------------------------------------------------------------------
# causal attention with causal block skipping (blas_attention.cpp)


def _attention_ref(q, k, v, g, scale, r):
    """float64 grouped causal attention and the grads of sum(out * g): written out from the
    definitions (scores, masked softmax, weighted sum; dS = P (dP - rowsum(dP P)))."""
    q, k, v, g = (a.astype(np.float64) for a in (q, k, v, g))
    lead, s, d = q.shape[:-2], k.shape[-2], q.shape[-1]
    Q, G = q.reshape(lead + (r, s, d)), g.reshape(lead + (r, s, d))
    K, V = k[..., None, :, :], v[..., None, :, :]
    S = Q @ K.swapaxes(-1, -2) * scale + np.triu(np.full((s, s), -np.inf), 1)
    P = np.exp(S - S.max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)
    out = P @ V
    dP = G @ V.swapaxes(-1, -2)
    dS = P * (dP - (dP * P).sum(-1, keepdims=True)) * scale
    dq = (dS @ K).reshape(q.shape)
    dk = (dS.swapaxes(-1, -2) @ Q).sum(-3)
    dv = (P.swapaxes(-1, -2) @ G).sum(-3)
    return out.reshape(q.shape), dq, dk, dv


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(1, 1, 1, 5, 3), (2, 2, 3, 130, 16), (1, 2, 2, 64, 8)],
                         ids=["one-block", "blocks-ragged-tail", "one-full-block"])
def test_causal_attention(blas_ok, mode, shape):
    """Query blocks of 64 rows: 130 positions end in a 2-row block; values and grads vs float64.
    Tolerance 2e-6 of the largest reference value: fp32 GEMMs over <= 130 terms (~1e-7 relative
    each) and an fp32 softmax (measured <= 4.4e-7)."""
    b, g, r, s, d = shape
    rng = np.random.default_rng(s + r)
    q = rng.standard_normal((b, g, r * s, d)).astype(np.float32)
    k = rng.standard_normal((b, g, s, d)).astype(np.float32)
    v = rng.standard_normal((b, g, s, d)).astype(np.float32)
    gr = rng.standard_normal((b, g, r * s, d)).astype(np.float32)
    scale = 1.0 / np.sqrt(d)
    gt = _t(gr)

    def fwd(a, bb, c):
        return ck.causal_attention(a, bb, c, scale)

    def loss(a, bb, c):
        return (ck.causal_attention(a, bb, c, scale) * gt).sum()

    grad = ms.grad(loss, (0, 1, 2))
    if mode == "jit":
        fwd, grad = ms.jit(fwd), ms.jit(grad)
    got = [fwd(_t(q), _t(k), _t(v)).asnumpy()] + [t.asnumpy() for t in grad(_t(q), _t(k), _t(v))]
    for name, a, ref in zip(("out", "dq", "dk", "dv"), got, _attention_ref(q, k, v, gr, scale, r)):
        err = np.abs(a - ref).max() / np.abs(ref).max()
        assert err <= 2e-6, f"{name}: max error {err:.2e} of max |ref|"
