"""The AOT element-wise kernels on bf16 tensors as they are (rms_norm, swiglu, rope; forward and
backward): the bf16 step no longer widens to fp32 and rounds back around each of them.

Reference: the same kernels' fp32 path on the widened inputs, rounded to bf16 (nearest even) with
ml_dtypes. The bf16 kernels widen on load (exact), run the identical fp32 arithmetic and round on
store. The two template instantiations may still vectorise a reduction or contract a multiply-add
differently (fp32 differences of ~1e-7 relative to the terms), which moves a value across a bf16
rounding boundary about once per 2^16 elements, and where rms_norm's dx cancels two O(1) terms
that fp32 difference is all that is left. Hence: |got - want| <= one bf16 ulp (<= 2^-7 relative)
+ 2^-16 of the tensor's largest value, on at most 1e-4 of the elements differing at all
(measured: 9 of 1.3M forward, 53 in dx). A layout, offset or rounding bug breaks far more.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from ms_llm.ops import cpu_kernels as ck
from ms_llm.ops.rope import rope_cos_sin

BF16 = ml_dtypes.bfloat16


@pytest.fixture(scope="module", autouse=True)
def _aot():
    from ms_llm.compat import setup_device
    setup_device("CPU")
    if not ck.available():
        pytest.skip(f"AOT kernels unavailable: {ck.reason()}")


def _pair(rng, shape, scale=1.0):
    """(bf16 tensor, fp32 tensor of the same values)."""
    a = (rng.standard_normal(shape) * scale).astype(np.float32).astype(BF16)
    return Tensor(a.astype(np.float32)).astype(ms.bfloat16), Tensor(a.astype(np.float32))


def _bits(t):
    return t.astype(ms.float32).asnumpy().astype(BF16).view(np.uint16)


def _rounded(t):
    return t.asnumpy().astype(BF16).view(np.uint16)


def _same(got, want, what):
    g = got.view(BF16).astype(np.float64)
    w = want.view(BF16).astype(np.float64)
    err = np.abs(g - w)
    tol = 2.0 ** -7 * np.abs(w) + 2.0 ** -16 * np.abs(w).max()
    assert (err <= tol).all() and (got != want).mean() <= 1e-4, \
        f"{what}: {(got != want).sum()} of {got.size} differ, max excess {(err - tol).max():.3g}"


@pytest.mark.parametrize("name", ["rms_norm", "swiglu", "rope"])
def test_bf16_kernels_equal_rounded_fp32_kernels(name):
    rng = np.random.default_rng({"rms_norm": 1, "swiglu": 2, "rope": 3}[name])
    cos, sin = rope_cos_sin(24, 16, 10000.0)
    if name == "rms_norm":   # 4096 rows x 320: above the kernels' threading threshold too
        (xb, x32), (wb, w32) = _pair(rng, (4, 1024, 320)), _pair(rng, (320,))
        fn, args_b, args_f = (lambda x, w: ck.rms_norm(x, w, 1e-5)), (xb, wb), (x32, w32)
        out_shape = (4, 1024, 320)
    elif name == "swiglu":
        (xb, x32), = [_pair(rng, (3, 50, 2 * 72), 2.0)]
        fn, args_b, args_f, out_shape = ck.swiglu, (xb,), (x32,), (3, 50, 72)
    else:
        (xb, x32), = [_pair(rng, (2, 3, 24, 16))]
        fn = lambda x: ck.rope(x, cos, sin, -2)  # noqa: E731
        args_b, args_f, out_shape = (xb,), (x32,), (2, 3, 24, 16)
    _, dy = _pair(rng, out_shape)   # bf16-exact fp32 values: its cast to bf16 below is exact
    yb, yf = fn(*args_b), fn(*args_f)
    assert yb.dtype == ms.bfloat16
    _same(_bits(yb), _rounded(yf), f"{name} forward")
    pos = tuple(range(len(args_b)))
    # d/d(inputs) of sum(fn(inputs) * dy): the output gradient is dy (in the output's dtype)
    gb = ms.grad(lambda *a: (fn(*a).astype(ms.float32) * dy).sum(), grad_position=pos)(*args_b)
    gf = ms.grad(lambda *a: (fn(*a) * dy).sum(), grad_position=pos)(*args_f)
    gb, gf = (gb if isinstance(gb, tuple) else (gb,)), (gf if isinstance(gf, tuple) else (gf,))
    for i, (b, f) in enumerate(zip(gb, gf)):
        assert b.dtype == ms.bfloat16, f"{name} grad {i} is {b.dtype}"
        _same(_bits(b), _rounded(f), f"{name} grad {i}")


def test_bf16_logits_cross_entropy_equals_the_fp32_kernel_on_widened_logits():
    """bf16 logits are read as they are: the loss (fp32) equals the fp32 kernel on the widened
    logits within fp32 summation-order differences (rtol 1e-6), and dlogits (bf16) equals its
    fp32 dlogits rounded, under the rule above; labels include an ignored and a repeated one."""
    rng = np.random.default_rng(4)
    lb, lf = _pair(rng, (64, 1000), 3.0)
    labels = Tensor(np.concatenate([[-100, 7, 7], rng.integers(0, 1000, 61)]).astype(np.int32))
    loss_b, loss_f = ck.cross_entropy(lb, labels), ck.cross_entropy(lf, labels)
    assert loss_b.dtype == ms.float32
    np.testing.assert_allclose(loss_b.asnumpy(), loss_f.asnumpy(), rtol=1e-6, atol=1e-6)
    assert loss_b.asnumpy()[0] == 0.0
    w = Tensor(rng.standard_normal(64).astype(np.float32))
    gb = ms.grad(lambda x: (ck.cross_entropy(x, labels) * w).sum())(lb)
    gf = ms.grad(lambda x: (ck.cross_entropy(x, labels) * w).sum())(lf)
    assert gb.dtype == ms.bfloat16
    _same(_bits(gb), _rounded(gf), "cross entropy dlogits")
    assert not _bits(gb)[0].any()          # the ignored row: +0.0
