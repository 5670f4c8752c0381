"""Muon's Newton-Schulz CPU kernel (``ms_llm.ops.cpu_kernels.optimizer.muon_ns``, ``blas_muon.cpp``)
against a NumPy float64 Newton-Schulz written here: wide, tall and square matrices and a batch, every
coefficient schedule shape (cycling quintic, the ``c = 0`` path), fp32 and bf16 GEMM operands.

Tolerances. fp32: 1e-5 relative to the largest element, the bound test_muon holds the composed form
to (fp32 rounding through 5 steps of a matrix polynomial of the normalised input: measured ~3e-6).
bf16 (``training.muon_fp32_matmul_prec: medium``): one step against the same NumPy iteration with
the operands of ``X X^T`` and ``B X`` rounded to bf16 (round-to-nearest-even; ``A A`` and ``a X``
from fp32 values) and float64 products, 1e-5 (the kernel accumulates in fp32; measured 3e-7). Over several steps an
element that lands next to a rounding boundary rounds the other way in one of the two (fp32 vs
float64 sums), and the flips grow into noise as large as bf16's own error, so five steps are held
against fp32 Newton-Schulz instead: within 5e-2, the precision this option trades (measured
1-2e-2), and in Frobenius norm within 1.25x of torch.optim.Muon's all-bf16 iteration's distance
(measured 1.0-1.15x over shapes and seeds: the same precision class).
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from mindspore import Tensor

from ms_llm.ops.cpu_kernels.optimizer.muon_ns import bf16_ns_available, newton_schulz_kernel, \
    ns_kernel_available

QUINTIC = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]
LINEAR = [(1.5, -0.5, 0.0)]          # c = 0: no A A product
EPS = 1e-15

pytestmark = pytest.mark.skipif(not ns_kernel_available(), reason="BLAS kernel library not built")


def bf16_round(x):
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def np_ns(x, coeffs, steps, bf16=False):
    """float64 Newton-Schulz of one matrix (iterated on its smaller side); ``bf16``: the operands
    of ``X X^T`` and ``B X`` rounded to bf16 first (``A A`` and ``a X`` from fp32 values), the
    products exact."""
    r = bf16_round if bf16 else (lambda v: v)
    t = x.shape[0] > x.shape[1]
    x = (x.T if t else x).astype(np.float64)
    x = (x / max(np.linalg.norm(x), EPS)).astype(np.float32).astype(np.float64)
    for a, b, c in itertools.islice(itertools.cycle(coeffs), steps):
        xr = r(x)
        g = (xr @ xr.T).astype(np.float32).astype(np.float64)
        gg = (g @ g).astype(np.float32) if c else 0.0
        if bf16:   # a X added in fp32, not folded into the rounded polynomial
            poly = (c * gg + b * g).astype(np.float32).astype(np.float64)
            x = (r(poly) @ xr + a * x).astype(np.float32).astype(np.float64)
        else:
            poly = (c * gg + b * g + a * np.eye(len(g))).astype(np.float32).astype(np.float64)
            x = (r(poly) @ xr).astype(np.float32).astype(np.float64)
    return x.T if t else x


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def fro(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (32, 32), (3, 16, 48), (2, 48, 16)])
@pytest.mark.parametrize("coeffs,steps", [(QUINTIC, 5), (LINEAR, 3)])
def test_fp32_kernel_matches_numpy(shape, coeffs, steps):
    x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    out = newton_schulz_kernel(Tensor(x), [tuple(c) for c in itertools.islice(
        itertools.cycle(coeffs), steps)], EPS).asnumpy()
    ref = np.stack([np_ns(m, coeffs, steps) for m in x.reshape((-1,) + shape[-2:])])
    assert out.shape == x.shape
    assert rel(out.reshape(ref.shape), ref) < 1e-5


def test_zero_matrix_stays_zero():
    """The norm clamps at eps: a zero momentum gives a zero update, not NaN."""
    out = newton_schulz_kernel(Tensor(np.zeros((8, 12), np.float32)), QUINTIC, EPS).asnumpy()
    assert np.all(out == 0)


@pytest.mark.parametrize("shape", [(48, 96), (96, 48)])
def test_bf16_kernel_matches_numpy_bf16_and_fp32(shape):
    ok, why = bf16_ns_available()
    if not ok:
        pytest.skip(why)
    x = np.random.default_rng(1).normal(size=shape).astype(np.float32)
    one = newton_schulz_kernel(Tensor(x), QUINTIC[:1], EPS, bf16=True).asnumpy()
    assert rel(one, np_ns(x, QUINTIC, 1, bf16=True)) < 1e-5
    out = newton_schulz_kernel(Tensor(x), QUINTIC, EPS, bf16=True).asnumpy()
    assert rel(out, np_ns(x, QUINTIC, 5)) < 5e-2
    # torch.optim.Muon's all-bf16 iteration (its quintic coefficients) lands as far from fp32
    from torch.optim._muon import _zeropower_via_newtonschulz
    simple = [(3.4445, -4.7750, 2.0315)]
    t = _zeropower_via_newtonschulz(torch.from_numpy(x), simple[0], 5, 1e-7).float().numpy()
    ours = newton_schulz_kernel(Tensor(x), simple * 5, EPS, bf16=True).asnumpy()
    exact = np_ns(x, simple, 5)
    assert fro(ours, exact) < 1.25 * fro(t, exact)
