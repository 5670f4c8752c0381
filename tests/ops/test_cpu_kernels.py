"""AOT C++ CPU kernels (ms_llm.ops.cpu_kernels): build/caching behaviour, and every kernel's forward and
backward against an independent float64 NumPy implementation, in PyNative and under mindspore.jit.
The composed MindSpore fallback (cpu_kernels.model.composed, used when the kernels are unavailable) is run
through the same checks.

The NumPy gradients are themselves checked against central finite differences of the NumPy forward
(float64, tiny shapes), so the references do not share a derivation with the C++ code.

Tolerances (fp32 result vs float64 reference):
  * O(1) outputs and grads (rms_norm, swiglu, rope, softmax probabilities, CE logits grad):
    rtol 1e-5, atol 1e-5. fp32 eps is 1.2e-7; the kernels do one reduction of <= 1000 terms (16-lane
    partial sums) plus a few flops per element, and their exp is a 6th-order polynomial of ~2 ulp, so
    errors of a few 1e-7 relative are expected. Measured: at most 11% of the tolerance.
  * rms_norm weight grad, a sum over all rows: rtol 1e-5, atol 1e-4 (measured: 1.4%).
  * cross-entropy loss, a logsumexp of up to ~150 in the logits*40 case: rtol 1e-5, atol 2e-5
    (measured: 26%, the worst case of the file).
  * fp16 / bf16 inputs (computed in fp32, rounded once at the output): 2e-3 / 2e-2, about 2 ulp of the
    output format (measured: 19%).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

ms.set_device("CPU")
ms.set_context(pynative_synchronize=True)

from ms_llm.ops import cpu_kernels as ck  # noqa: E402
from helpers.paths import ROOT  # noqa: E402
from ms_llm.ops.cpu_kernels import build  # noqa: E402
from ms_llm.ops.cpu_kernels.model import composed  # noqa: E402

REPO = Path(ROOT)
HAVE_CXX = build._compiler() is not None
# CPU training speed depends on the C++ kernels, so a machine that cannot build or load them fails
# these tests instead of skipping them. The explicit opt-out, for a machine without a compiler
# (where training still works on the composed fallback, only slower):
ALLOW_COMPOSED = "MS_LLM_ALLOW_COMPOSED_KERNELS"


def composed_allowed() -> bool:
    return os.environ.get(ALLOW_COMPOSED, "0") == "1"


needs_aot = pytest.mark.skipif(not HAVE_CXX and composed_allowed(),
                               reason=f"no C++ compiler and {ALLOW_COMPOSED}=1")

TOL = dict(rtol=1e-5, atol=1e-5)
MODES = ["pynative", "jit"]


# ---------------------------------------------------------------------------------------------------
# Independent float64 NumPy references (forward, and vector-Jacobian product for output grad g)


def np_rms(x, w, eps):
    r = 1.0 / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)
    return x * r * w


def np_rms_vjp(x, w, eps, g):
    h = x.shape[-1]
    ms_ = np.mean(x * x, -1, keepdims=True) + eps
    r = ms_**-0.5
    # y_j = w_j x_j r ; dr/dx_k = -x_k r^3 / h
    dx = g * w * r - x * (r**3) * np.sum(g * w * x, -1, keepdims=True) / h
    dw = np.sum((g * x * r).reshape(-1, h), 0)
    return dx, dw


def _sig(a):
    return 1.0 / (1.0 + np.exp(-a))


def np_swiglu(x):
    f = x.shape[-1] // 2
    a, b = x[..., :f], x[..., f:]
    return a * _sig(a) * b


def np_swiglu_vjp(x, g):
    f = x.shape[-1] // 2
    a, b = x[..., :f], x[..., f:]
    s = _sig(a)
    return np.concatenate([g * b * (s + a * s * (1 - s)), g * a * s], -1)


def np_ce(logits, labels, ignore):
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[:, 0]
    keep = labels != ignore
    safe = np.where(keep, labels, 0)
    return np.where(keep, lse - logits[np.arange(len(labels)), safe], 0.0)


def np_ce_vjp(logits, labels, ignore, g):
    m = logits.max(-1, keepdims=True)
    p = np.exp(logits - m)
    p /= p.sum(-1, keepdims=True)
    keep = labels != ignore
    p[np.arange(len(labels))[keep], labels[keep]] -= 1.0
    return p * (g * keep)[:, None]


def _rope_b(x, c, seq_dim):
    shape = [1] * x.ndim
    sd = seq_dim % x.ndim
    shape[sd], shape[-1] = x.shape[sd], x.shape[-1]
    return c.reshape(shape)


def np_rope(x, cos, sin, seq_dim):
    h = x.shape[-1] // 2
    rot = np.concatenate([-x[..., h:], x[..., :h]], -1)
    return x * _rope_b(x, cos, seq_dim) + rot * _rope_b(x, sin, seq_dim)


def np_rope_vjp(x, cos, sin, seq_dim, g):
    h = x.shape[-1] // 2
    u = g * _rope_b(x, sin, seq_dim)
    # transpose of rotate_half: [u1, u2] -> [u2, -u1]
    return g * _rope_b(x, cos, seq_dim) + np.concatenate([u[..., h:], -u[..., :h]], -1)


def _keep(sq, sk):
    return np.tril(np.ones((sq, sk), bool), k=sk - sq)


def np_csm(x, scale):
    keep = _keep(*x.shape[-2:])
    z = np.where(keep, scale * x, -np.inf)
    m = np.max(z, -1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(keep, np.exp(z - m), 0.0)
    den = e.sum(-1, keepdims=True)
    return np.where(den > 0, e / np.where(den > 0, den, 1.0), 0.0)


def np_csm_vjp(x, scale, g):
    y = np_csm(x, scale)
    return scale * y * (g - np.sum(g * y, -1, keepdims=True))


def _fd_check(fwd, vjp_value, x, g, eps=1e-6, n=12, seed=0):
    """Central differences of sum(fwd(x) * g) at n random coordinates vs the analytic vjp."""
    rng = np.random.default_rng(seed)
    idx = [tuple(rng.integers(0, s) for s in x.shape) for _ in range(n)]
    for i in idx:
        xp, xm = x.copy(), x.copy()
        xp[i] += eps
        xm[i] -= eps
        fd = (np.sum(fwd(xp) * g) - np.sum(fwd(xm) * g)) / (2 * eps)
        assert abs(fd - vjp_value[i]) < 1e-6 * max(1.0, abs(fd)), (i, fd, vjp_value[i])


def test_numpy_references_match_finite_differences():
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((3, 6)), rng.standard_normal(6)
    g = rng.standard_normal((3, 6))
    dx, dw = np_rms_vjp(x, w, 1e-5, g)
    _fd_check(lambda t: np_rms(t, w, 1e-5), dx, x, g)
    _fd_check(lambda t: np_rms(x, t, 1e-5), dw, w, g)

    x = rng.standard_normal((3, 8)) * 3
    g = rng.standard_normal((3, 4))
    _fd_check(np_swiglu, np_swiglu_vjp(x, g), x, g)

    logits = rng.standard_normal((5, 7)) * 3
    labels = np.array([0, -100, 6, 3, -100])
    g = rng.standard_normal(5)
    _fd_check(lambda t: np_ce(t, labels, -100), np_ce_vjp(logits, labels, -100, g), logits, g)

    x = rng.standard_normal((2, 4, 3, 6))
    cos, sin = rng.standard_normal((4, 6)), rng.standard_normal((4, 6))
    g = rng.standard_normal(x.shape)
    _fd_check(lambda t: np_rope(t, cos, sin, 1), np_rope_vjp(x, cos, sin, 1, g), x, g)

    for shape in [(2, 5, 5), (1, 3, 6)]:
        x = rng.standard_normal(shape)
        g = rng.standard_normal(shape)
        _fd_check(lambda t: np_csm(t, 0.7), np_csm_vjp(x, 0.7, g), x, g)


# ---------------------------------------------------------------------------------------------------
# helpers


def _t(a, dtype=np.float32):
    return Tensor(np.asarray(a, dtype=dtype))


def _run(fn, args, grad_pos, g, mode):
    """Forward output and grads (w.r.t. grad_pos) of sum(fn(*args) * g), in PyNative or under jit."""

    def loss(*a):
        return (fn(*a) * g).sum()

    fwd = fn
    grad = ms.grad(loss, grad_pos)
    if mode == "jit":
        fwd = ms.jit(fn)
        grad = ms.jit(grad)
    y = fwd(*args)
    gr = grad(*args)
    if not isinstance(gr, tuple):
        gr = (gr,)
    return y.asnumpy(), [x.asnumpy() for x in gr]


def unavailable(what: str, reason: str) -> None:
    """Fail (the default) or, with the explicit opt-out, skip: never a silent skip."""
    if composed_allowed():
        pytest.skip(f"{what} unavailable ({reason}); allowed by {ALLOW_COMPOSED}=1")
    pytest.fail(f"{what} must be active on this machine: {reason} (set {ALLOW_COMPOSED}=1 "
                f"only where no C++ compiler can be installed)")


@pytest.fixture(scope="module")
def aot():
    if not ck.available():   # also False under MS_LLM_DISABLE_AOT, with that as the reason
        unavailable("the C++ CPU kernels", ck.reason())
    return ck


@pytest.fixture(params=["aot", "composed"])
def impl(request):
    """The module under test: the AOT kernels, or the composed fallback used when they are unavailable."""
    if request.param == "composed":
        return composed
    return request.getfixturevalue("aot")


def test_native_kernels_are_the_active_path():
    """What a training run on this machine picks, in a fresh process (no test's monkeypatching or
    cached choice in between): every op with a C++ kernel takes it, including the BLAS matmuls."""
    code = ("import json; from ms_llm.ops import cpu_kernels as ck; "
            "from ms_llm.ops._dispatch import AOT_OPS, resolve_paths; p = resolve_paths(); "
            "print(json.dumps({'paths': {op: p[op] for op in AOT_OPS}, "
            "'reasons': [ck.reason(), ck.blas_reason()]}))")
    env = dict(os.environ, PYTHONPATH=str(REPO), GLOG_v="3", MS_LLM_DEVICE="CPU")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    import json
    got = json.loads(r.stdout.strip().splitlines()[-1])
    slow = sorted(op for op, path in got["paths"].items() if path != "aot")
    if slow:
        unavailable(f"the C++ kernels for {', '.join(slow)}",
                    "; ".join(str(x) for x in got["reasons"] if x))


# ---------------------------------------------------------------------------------------------------
# build / availability


@needs_aot
def test_available_and_cached(aot):
    path = ck.library_path()
    assert path is not None and path.is_file()
    assert path.parent.parent == build.cache_root()
    assert path.parent.name == build.build_key(build._compiler(), build._BASE_FLAGS + [build._OPENMP_FLAG])
    assert ck.available()  # second call is cached


@needs_aot
def test_fresh_cache_concurrent_build(tmp_path):
    """Two processes build into an empty cache at once: both succeed, one library, no temp files."""
    code = (
        "import logging, sys; logging.basicConfig(level=logging.INFO); "
        "from ms_llm.ops.cpu_kernels import build; "
        "p = build.library_path(); print(p); sys.exit(0 if p else 1)"
    )
    env = dict(os.environ, MS_LLM_CACHE=str(tmp_path), PYTHONPATH=str(REPO))
    env.pop("MS_LLM_DISABLE_AOT", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    paths = {out.strip().splitlines()[-1] for out, _ in outs}
    assert len(paths) == 1
    built = list((tmp_path / "kernels").rglob("*.so"))
    assert [str(b) for b in built] == list(paths)
    assert not [f for f in (tmp_path / "kernels").rglob("*.tmp")]
    assert sum(err.count("AOT kernels: compiling") for _, err in outs) == 1  # the loser of the lock reuses it


def test_unavailable_paths_log_reason_and_fall_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("MS_LLM_CACHE", str(tmp_path))
    monkeypatch.delenv("MS_LLM_DISABLE_AOT", raising=False)
    try:
        # no compiler
        build._reset_for_tests()
        monkeypatch.setenv("MS_LLM_CXX", str(tmp_path / "no-such-g++"))
        monkeypatch.setattr(build.shutil, "which", lambda name: None)
        with caplog.at_level("WARNING", logger="ms_llm.ops.cpu_kernels"):
            assert not ck.available()
            assert not ck.available()
        assert "no C++ compiler" in ck.reason()
        assert sum("unavailable" in r.getMessage() for r in caplog.records) == 1  # logged once
        monkeypatch.undo()
        monkeypatch.setenv("MS_LLM_CACHE", str(tmp_path))
        monkeypatch.delenv("MS_LLM_DISABLE_AOT", raising=False)

        # compiler present but compilation fails
        if HAVE_CXX:
            build._reset_for_tests()
            broken = build._BASE_FLAGS + ["-DMSLLM_FORCE_ERROR", "-include", "nonexistent.h"]
            monkeypatch.setattr(build, "_BASE_FLAGS", broken)
            assert not ck.available()
            assert "compilation failed" in ck.reason()
            monkeypatch.setattr(build, "_BASE_FLAGS", build._BASE_FLAGS[:-3])

        # disabled by env: the public functions still work (composed path) and are correct
        build._reset_for_tests()
        monkeypatch.setenv("MS_LLM_DISABLE_AOT", "1")
        assert not ck.available()
        assert "MS_LLM_DISABLE_AOT" in ck.reason()
        rng = np.random.default_rng(0)
        x, w = rng.standard_normal((4, 96)).astype(np.float32), rng.standard_normal(96).astype(np.float32)
        np.testing.assert_allclose(ck.rms_norm(_t(x), _t(w), 1e-5).asnumpy(), np_rms(x, w, 1e-5), **TOL)
        xs = rng.standard_normal((3, 10)).astype(np.float32)
        np.testing.assert_allclose(ck.swiglu(_t(xs)).asnumpy(), np_swiglu(xs), **TOL)
        lg = rng.standard_normal((5, 11)).astype(np.float32)
        lab = np.array([1, -100, 10, 0, 3], np.int32)
        np.testing.assert_allclose(
            ck.cross_entropy(_t(lg), _t(lab, np.int32)).asnumpy(), np_ce(lg, lab, -100), rtol=1e-5, atol=2e-5
        )
    finally:
        monkeypatch.undo()
        build._reset_for_tests()


# ---------------------------------------------------------------------------------------------------
# kernels vs NumPy, PyNative and jit


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape,eps", [((7, 96), 1e-5), ((2, 5, 96), 1e-6), ((3, 512), 1e-6)])
def test_rms_norm(impl, mode, shape, eps):
    rng = np.random.default_rng(2)
    x = rng.standard_normal(shape).astype(np.float32) * 2 + 0.5
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)

    def fn(a, b):
        return impl.rms_norm(a, b, eps)

    y, (dx, dw) = _run(fn, (_t(x), _t(w)), (0, 1), _t(g), mode)
    x64, w64, g64 = x.astype(np.float64), w.astype(np.float64), g.astype(np.float64)
    np.testing.assert_allclose(y, np_rms(x64, w64, eps), **TOL)
    rdx, rdw = np_rms_vjp(x64, w64, eps, g64)
    np.testing.assert_allclose(dx, rdx, **TOL)
    np.testing.assert_allclose(dw, rdw, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(5, 2 * 37), (2, 3, 2 * 64)])
def test_swiglu(impl, mode, shape):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(shape) * 4).astype(np.float32)
    x.reshape(-1)[:4] = [-120.0, 120.0, -30.0, 0.0]  # saturated sigmoid on both sides
    g = rng.standard_normal(shape[:-1] + (shape[-1] // 2,)).astype(np.float32)
    y, (dx,) = _run(impl.swiglu, (_t(x),), (0,), _t(g), mode)
    assert y.shape == g.shape
    np.testing.assert_allclose(y, np_swiglu(x.astype(np.float64)), **TOL)
    np.testing.assert_allclose(dx, np_swiglu_vjp(x.astype(np.float64), g.astype(np.float64)), **TOL)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "n,v,ignore,label_dtype,scale",
    [(37, 257, -100, np.int32, 1.0), (13, 1000, 3, np.int64, 1.0), (9, 64, -100, np.int32, 40.0)],
)
def test_cross_entropy(impl, mode, n, v, ignore, label_dtype, scale):
    rng = np.random.default_rng(4)
    logits = (rng.standard_normal((n, v)) * scale).astype(np.float32)
    labels = rng.integers(0, v, n)
    labels[0], labels[1] = v - 1, 0
    labels[2::5] = ignore  # ignored rows, including a custom ignore_index that is a valid class id
    labels = labels.astype(label_dtype)
    g = rng.standard_normal(n).astype(np.float32)
    lab_t = Tensor(labels)

    def fn(x):
        return impl.cross_entropy(x, lab_t, ignore)

    y, (dx,) = _run(fn, (_t(logits),), (0,), _t(g), mode)
    l64 = logits.astype(np.float64)
    ref = np_ce(l64, labels, ignore)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=2e-5)
    assert np.all(y[labels == ignore] == 0)
    np.testing.assert_allclose(dx, np_ce_vjp(l64, labels, ignore, g.astype(np.float64)), **TOL)
    assert np.all(dx[labels == ignore] == 0)


@needs_aot
def test_cross_entropy_nd_and_all_ignored(aot):
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((2, 3, 17)).astype(np.float32)
    labels = np.array([[1, -100, 16], [-100, 0, 5]], np.int32)
    y = ck.cross_entropy(_t(logits), Tensor(labels)).asnumpy()
    assert y.shape == (2, 3)
    ref = np_ce(logits.reshape(-1, 17).astype(np.float64), labels.reshape(-1), -100)
    np.testing.assert_allclose(y.reshape(-1), ref, rtol=1e-5, atol=2e-5)
    lab = Tensor(np.full(4, -100, np.int32))
    x = _t(rng.standard_normal((4, 17)))
    assert np.all(ck.cross_entropy(x, lab).asnumpy() == 0)
    assert np.all(ms.grad(lambda t: ck.cross_entropy(t, lab).sum())(x).asnumpy() == 0)


@needs_aot
def test_cross_entropy_bad_label_raises(aot):
    x = _t(np.zeros((3, 5)))
    with pytest.raises(RuntimeError):
        ck.cross_entropy(x, Tensor(np.array([0, 5, 1], np.int32))).asnumpy()
    # the process keeps working afterwards
    assert ck.cross_entropy(x, Tensor(np.array([0, 4, 1], np.int32))).asnumpy().shape == (3,)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape,seq_dim", [((2, 3, 5, 10), -2), ((2, 5, 3, 10), 1), ((5, 2, 3, 8), 0)])
def test_rope(impl, mode, shape, seq_dim):
    rng = np.random.default_rng(6)
    x = rng.standard_normal(shape).astype(np.float32)
    s, d = shape[seq_dim], shape[-1]
    pos = np.arange(s)[:, None] / (10000.0 ** (np.arange(0, d, 2) / d))[None, :]
    ang = np.concatenate([pos, pos], -1)
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    cos_t, sin_t = _t(cos), _t(sin)

    def fn(a):
        return impl.rope(a, cos_t, sin_t, seq_dim)

    y, (dx,) = _run(fn, (_t(x),), (0,), _t(g), mode)
    c64, s64 = cos.astype(np.float64), sin.astype(np.float64)
    np.testing.assert_allclose(y, np_rope(x.astype(np.float64), c64, s64, seq_dim), **TOL)
    np.testing.assert_allclose(dx, np_rope_vjp(x.astype(np.float64), c64, s64, seq_dim, g.astype(np.float64)), **TOL)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape,scale", [((2, 3, 7, 7), 0.3), ((1, 2, 5, 9), 1.0), ((1, 1, 6, 4), 0.5)])
def test_causal_softmax(impl, mode, shape, scale):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)

    def fn(a):
        return impl.causal_softmax(a, scale)

    y, (dx,) = _run(fn, (_t(x),), (0,), _t(g), mode)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(y, np_csm(x64, scale), **TOL)
    assert np.all(y[..., ~_keep(*shape[-2:])] == 0)  # masked (and fully masked rows) are exactly 0
    np.testing.assert_allclose(dx, np_csm_vjp(x64, scale, g.astype(np.float64)), **TOL)


# ---------------------------------------------------------------------------------------------------
# dtypes, layouts, Cells


@needs_aot
@pytest.mark.parametrize("dtype,tol", [(ms.float16, 2e-3), (ms.bfloat16, 2e-2)])
def test_low_precision_inputs_are_upcast(aot, dtype, tol):
    rng = np.random.default_rng(8)
    x = rng.standard_normal((6, 96)).astype(np.float32)
    w = rng.standard_normal(96).astype(np.float32)
    xl, wl = _t(x).astype(dtype), _t(w).astype(dtype)
    x32, w32 = xl.astype(ms.float32).asnumpy(), wl.astype(ms.float32).asnumpy()  # the rounded inputs
    for out, ref in [
        (ck.rms_norm(xl, wl, 1e-6), np_rms(x32, w32, 1e-6)),
        (ck.swiglu(xl), np_swiglu(x32)),
    ]:
        assert out.dtype == dtype
        np.testing.assert_allclose(out.astype(ms.float32).asnumpy(), ref, rtol=tol, atol=tol)
    lab = np.array([0, 1, -100, 95, 3, 4], np.int32)
    ce = ck.cross_entropy(xl, Tensor(lab))
    assert ce.dtype == ms.float32
    np.testing.assert_allclose(ce.asnumpy(), np_ce(x32, lab, -100), rtol=1e-5, atol=2e-5)


@needs_aot
def test_non_contiguous_inputs(aot):
    rng = np.random.default_rng(9)
    x = rng.standard_normal((96, 5)).astype(np.float32)
    w = np.ones(96, np.float32)
    xt = _t(x).transpose(1, 0)
    np.testing.assert_allclose(ck.rms_norm(xt, _t(w)).asnumpy(), np_rms(x.T.astype(np.float64), w, 1e-6), **TOL)
    big = rng.standard_normal((6, 12)).astype(np.float32)
    ref = np_swiglu(big[:, 2:10].astype(np.float64))
    np.testing.assert_allclose(ck.swiglu(_t(big)[:, 2:10]).asnumpy(), ref, **TOL)


class _Block(nn.Cell):
    """norm -> fused fc1 -> swiglu -> head -> per-token CE, with the kernels under test."""

    def __init__(self, mod, h=96, f=40, v=257, seed=0):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.mod = mod
        self.norm_w = Parameter(_t(1 + 0.1 * rng.standard_normal(h)), name="norm_w")
        self.fc1 = Parameter(_t(0.1 * rng.standard_normal((h, 2 * f))), name="fc1")
        self.head = Parameter(_t(0.1 * rng.standard_normal((f, v))), name="head")

    def construct(self, x, labels):
        h = self.mod.rms_norm(x, self.norm_w, 1e-6)
        h = self.mod.swiglu(ops.matmul(h, self.fc1))
        loss = self.mod.cross_entropy(ops.matmul(h, self.head), labels)
        return loss.sum() / (labels != -100).astype(ms.float32).sum()


@needs_aot
@pytest.mark.parametrize("mode", MODES)
def test_cell_value_and_grad_matches_composed(aot, mode):
    rng = np.random.default_rng(10)
    x = _t(rng.standard_normal((23, 96)))
    lab = rng.integers(0, 257, 23).astype(np.int32)
    lab[::4] = -100
    lab_t = Tensor(lab)
    results = []
    for mod in (ck, composed):
        net = _Block(mod)
        fn = ms.value_and_grad(net, None, net.trainable_params())
        if mode == "jit":
            fn = ms.jit(fn)
        loss, grads = fn(x, lab_t)
        results.append((float(loss.asnumpy()), [g.asnumpy() for g in grads]))
    (l1, g1), (l2, g2) = results
    assert abs(l1 - l2) < 1e-5 * max(1.0, abs(l2))
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
