"""oneDNN's bf16 matmul primitive (``runtime.bf16_gemm: dnnl``, ms_llm/ops/cpu_kernels/gemm/dnnl*)
against NumPy (float64 product of the same bf16 inputs) and torch's bf16 matmul, and the choice
``auto`` / ``dnnl`` makes. The kernels' linear / bmm through it are covered by test_bf16.py's
``gemm_path`` fixture (param "dnnl")."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ms_llm.ops.cpu_kernels.gemm import bf16 as bf16_gemm

BF16 = ml_dtypes.bfloat16
needs_units = pytest.mark.skipif(not bf16_gemm.cpu_bf16_units(),
                                 reason="no AVX512-BF16/AMX-BF16 units (dnnl is refused here)")


@pytest.fixture(scope="module")
def dnnl():
    from ms_llm.compat import setup_device
    setup_device("CPU")
    from ms_llm.ops.cpu_kernels.gemm import dnnl as dnnl_gemm
    dnnl_gemm.load_dnnl_gemm(2)
    return dnnl_gemm


def _bf16(rng, shape):
    return rng.standard_normal(shape).astype(np.float32).astype(BF16)


@needs_units
@pytest.mark.parametrize("m,n,k", [(64, 48, 40), (333, 129, 517), (1, 7, 1000)])
def test_matmul_primitive_matches_float64_product(dnnl, m, n, k):
    """fp32 output against the float64 product of the same bf16 values. Every product of two bf16
    numbers is exact in fp32 (8+8 significant bits), so the only error is fp32 accumulation:
    |err| <= gamma_k * (|A| @ |B|) with gamma_k = k u / (1 - k u), u = 2^-24 (Higham, Thm 3.5),
    checked elementwise with no extra margin; a wrong transpose or stride gives O(1) errors."""
    rng = np.random.default_rng(m + n + k)
    for ta in (False, True):
        for tb in (False, True):
            a, b = _bf16(rng, (k, m) if ta else (m, k)), _bf16(rng, (n, k) if tb else (k, n))
            c = np.empty((m, n), np.float32)
            dnnl.matmul_bf16(a.view(np.uint16), b.view(np.uint16), c, trans_a=ta, trans_b=tb)
            a64, b64 = a.astype(np.float64), b.astype(np.float64)
            a64, b64 = (a64.T if ta else a64), (b64.T if tb else b64)
            bound = k * 2.0 ** -24 / (1 - k * 2.0 ** -24) * (np.abs(a64) @ np.abs(b64))
            err = np.abs(c - a64 @ b64)
            assert (err <= bound).all(), f"ta={ta} tb={tb}: max excess {(err - bound).max():.3g}"


@needs_units
def test_bf16_output_matches_torch_bf16_matmul(dnnl):
    """bf16 output (rounded from the fp32 accumulator) against torch's bf16 linear on the same
    operands: both round an fp32-accumulated product, so they differ by at most one bf16 ulp
    (2^-8 relative; summation order only moves values that sit on a rounding boundary)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    x, w = _bf16(rng, (256, 192)), _bf16(rng, (96, 192))
    c = np.empty((256, 96), np.uint16)
    dnnl.matmul_bf16(x.view(np.uint16), w.view(np.uint16), c, trans_b=True)
    ours = c.view(BF16).astype(np.float64)
    tx = torch.from_numpy(x.view(np.uint16).astype(np.int16)).view(torch.bfloat16)
    tw = torch.from_numpy(w.view(np.uint16).astype(np.int16)).view(torch.bfloat16)
    theirs = torch.nn.functional.linear(tx, tw).double().numpy()
    assert np.abs(ours - theirs).max() <= 2.0 ** -8 * np.abs(theirs).max()
    assert (np.abs(ours - theirs) <= 2.0 ** -7 * np.abs(theirs) + 1e-30).mean() > 0.999
    assert dnnl.cached_primitives() >= 1


def test_choice_refuses_dnnl_without_units_and_auto_falls_back():
    with pytest.raises(RuntimeError, match="runtime.bf16_gemm dnnl: this CPU has no AVX512-BF16"):
        bf16_gemm._pick("dnnl", [], 2)
    assert bf16_gemm._pick("auto", [], 2)[0] == "openblas"
    assert bf16_gemm._pick("openblas", ["avx512_bf16"], 2)[0] == "openblas"


@needs_units
def test_auto_picks_dnnl_on_bf16_units(dnnl):
    path, addr, why = bf16_gemm._pick("auto", bf16_gemm.cpu_bf16_units(), 2)
    assert (path, addr) == ("dnnl", dnnl.load_dnnl_gemm(2)) and "oneDNN 3." in why
