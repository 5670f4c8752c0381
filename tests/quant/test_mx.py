"""``ms_llm.quant.mx.to_mx`` against an independent NumPy/ml_dtypes implementation of the OCP MX
v1.0 spec (tests/helpers/mx_reference.py: float64 arithmetic, ml_dtypes' fp8 casts for element
rounding).

Tolerance: none. Codes and scales must be bit-identical; dequantized values must be identical
except that values below the smallest fp32 normal are flushed to signed zero (documented in
``ms_llm.quant.mx``; the reference applies the same documented rule)."""
import ml_dtypes
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from helpers.mx_reference import ref_to_mx
from ms_llm.quant.mx import fake_quantize, to_mx


def spec_cases(rng) -> np.ndarray:
    """Rows of 32-element blocks, one scenario per row (plus random rows)."""
    rows = []
    rows += list(rng.standard_normal((8, 32)))                                   # random normal
    mag = 10.0 ** rng.uniform(-30, 30, (8, 32)) * rng.choice([-1, 1], (8, 32))   # 1e-30 .. 1e30
    rows += list(mag)
    rows += [np.zeros(32), -np.zeros(32)]                                        # all-zero blocks
    rows += [2.0 ** rng.integers(-126, 127, 32) * rng.choice([-1, 1], 32)]      # powers of two
    rows += [np.concatenate([[2.0 ** k], 2.0 ** (k - np.arange(1, 32))]) for k in (-120, 0, 100)]
    for k in (-20, -1, 0, 3, 40):                                                # maxima ~448*2^k
        for top in (448.0, 447.9, 448.1, 463.9, 464.0, 464.1, 480.0, 511.9, 512.0, 57344.0,
                    61440.0, 65535.0, 1.75, 1.7500001, 3.5000002):
            rows.append(np.concatenate([[top * 2.0 ** k], rng.standard_normal(31) * 2.0 ** k]))
    # subnormal results: block max 448 (e = 0 for E4M3) and elements down to 2^-12
    rows.append(np.concatenate([[448.0], 2.0 ** -np.linspace(5, 12, 31)]))
    rows.append(np.concatenate([[448.0], rng.uniform(-2 ** -6, 2 ** -6, 31)]))
    rows.append(np.concatenate([[57344.0], rng.uniform(-2 ** -14, 2 ** -14, 31)]))
    # rounding ties: midpoints between neighbouring E4M3 / E5M2 values (scale 2^0)
    grid4 = np.array([1.0, 1.125, 2.0, 2.25, 64.0, 72.0, 2 ** -9, 2 * 2 ** -9, 2 ** -6])
    ties4 = np.concatenate([(grid4[:-1] + grid4[1:]) / 2, [1.0625, 1.1875, 1.3125, 2 ** -10,
                                                          3 * 2 ** -10, 5 * 2 ** -10]])
    rows.append(np.concatenate([[448.0], ties4, -ties4, np.zeros(31 - 2 * len(ties4))]))
    ties5 = np.array([1.125, 1.375, 1.625, 1.875, 2 ** -17, 3 * 2 ** -17, 5 * 2 ** -17, 2.25])
    rows.append(np.concatenate([[57344.0], ties5, -ties5, np.zeros(31 - 2 * len(ties5))]))
    # NaN and Inf blocks
    for bad in (np.nan, np.inf, -np.inf):
        r = rng.standard_normal(32)
        r[7] = bad
        rows.append(r)
    # fp32 subnormal inputs (MindSpore's kernels may treat them as zero: the code must not care)
    rows.append(np.concatenate([[2.0 ** -127], 2.0 ** -np.arange(128, 149),
                                -2.0 ** -np.arange(140, 150)]))
    rows.append(np.concatenate([[2.0 ** -118], rng.uniform(-2 ** -126, 2 ** -126, 31)]))
    rows.append(np.concatenate([[1e-38], rng.uniform(-2 ** -126, 2 ** -126, 31)]))
    return np.array(rows, np.float64).astype(np.float32)


def _same_bits(a, b):
    return np.array_equal(np.nan_to_num(a).view(np.uint32), np.nan_to_num(b).view(np.uint32)) \
        and np.array_equal(np.isnan(a), np.isnan(b))


def _check(x, elem, mode, axis, tag):
    codes, scale, deq, has_sub = ref_to_mx(x, elem, mode, axis)
    m = to_mx(x, elem_dtype=elem, axis=axis, scale_mode=mode)
    assert m.qdata.dtype == np.uint8 and m.scale.dtype == np.uint8, tag
    assert m.qdata.shape == x.shape and m.scale.shape == scale.shape, tag
    bad_s = np.argwhere(m.scale != scale)
    assert bad_s.size == 0, f"{tag}: scale mismatch at {bad_s[:3].tolist()}"
    bad_c = np.argwhere(m.qdata != codes)
    assert bad_c.size == 0, (f"{tag}: {len(bad_c)} code mismatches, first at {bad_c[0].tolist()}: "
                             f"x={x[tuple(bad_c[0])]!r} got {m.qdata[tuple(bad_c[0])]:#x} "
                             f"want {codes[tuple(bad_c[0])]:#x}")
    got = m.dequantize()
    np.testing.assert_array_equal(got.view(np.uint32)[~np.isnan(deq)],
                                  deq.view(np.uint32)[~np.isnan(deq)], err_msg=tag)
    assert np.array_equal(np.isnan(got), np.isnan(deq)), tag
    # The training path's one-pass fake quantization equals dequantize(to_mx(x)) bit for bit;
    # its float-only (jit-able) form everywhere but in blocks holding fp32-subnormal inputs.
    fq = fake_quantize(Tensor(x), axis, elem, mode, exact_subnormals=True).asnumpy()
    assert _same_bits(fq, got), tag
    fq = fake_quantize(Tensor(x), axis, elem, mode).asnumpy()
    assert _same_bits(fq[~has_sub], got[~has_sub]), tag
    assert has_sub.sum() < has_sub.size // 10, tag


@pytest.mark.parametrize("elem", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_to_mx_matches_spec_reference(elem, mode):
    rng = np.random.default_rng(0)
    x = spec_cases(rng)                                   # [rows, 32]: blocks along axis -1
    _check(x, elem, mode, -1, f"{elem}/{mode}/axis-1")
    _check(np.ascontiguousarray(x.T), elem, mode, 0, f"{elem}/{mode}/axis0")
    # 3-d, middle axis, length not divisible by 32 (padded, never truncated)
    y = rng.standard_normal((3, 100, 5)) * 10.0 ** rng.uniform(-3, 3, (3, 1, 5))
    y = y.astype(np.float32)
    _check(y, elem, mode, 1, f"{elem}/{mode}/3d-axis1")
    assert to_mx(y, elem_dtype=elem, axis=1).scale.shape == (3, 4, 5)


def test_reference_sanity():
    """The reference itself on hand-computed values (guards against a wrong reference)."""
    x = np.zeros(32, np.float32)
    x[0], x[1], x[2], x[3] = 448.0, 1.0625, -1e-9, 3 * 2 ** -10   # tie 1.0625 -> 1.0 (even)
    codes, scale, deq, _ = ref_to_mx(x[None], "float8_e4m3fn", "floor", -1)
    assert scale[0, 0] == 127 and codes[0, 0] == 0x7E and codes[0, 1] == 0x38
    assert codes[0, 2] == 0x80 and codes[0, 3] == 0x02       # -0; 3*2^-10 ties to 2*2^-9
    _, scale, _, _ = ref_to_mx(np.full((1, 32), 449.0, np.float32), "float8_e4m3fn", "rceil", -1)
    assert scale[0, 0] == 128                                 # 449/448 > 1 -> 2^1
    _, scale, _, _ = ref_to_mx(np.full((1, 32), 448.0, np.float32), "float8_e4m3fn", "rceil", -1)
    assert scale[0, 0] == 127


def test_tensor_inputs_and_dtypes():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((8, 64)) * 3).astype(np.float32)
    m_np = to_mx(x)
    m_ms = to_mx(Tensor(x))
    assert isinstance(m_ms.qdata, Tensor) and m_ms.qdata.dtype == ms.uint8
    assert np.array_equal(m_ms.qdata.asnumpy(), m_np.qdata)
    assert np.array_equal(m_ms.scale.asnumpy(), m_np.scale)
    assert np.array_equal(m_ms.dequantize().asnumpy(), m_np.dequantize())
    for dt, npdt in ((ms.bfloat16, ml_dtypes.bfloat16), (ms.float16, np.float16)):
        xr = x.astype(npdt).astype(np.float32)                # the exactly-upcast values
        m = to_mx(Tensor(x).astype(dt), elem_dtype="float8_e5m2", scale_mode="rceil")
        codes, scale, _, _ = ref_to_mx(xr, "float8_e5m2", "rceil", -1)
        assert np.array_equal(m.qdata.asnumpy(), codes) and np.array_equal(m.scale.asnumpy(), scale)
    assert (m_np.axis, m_np.elem_dtype) == (1, "float8_e4m3fn")


def test_bad_arguments_are_clear_errors():
    x = np.ones((4, 32), np.float32)
    with pytest.raises(ValueError, match="elem_dtype"):
        to_mx(x, elem_dtype="float4_e2m1")
    with pytest.raises(ValueError, match="scale_mode"):
        to_mx(x, scale_mode="ceil")
    with pytest.raises(ValueError, match="axis"):
        to_mx(x, axis=2)
    with pytest.raises(TypeError, match="floating"):
        to_mx(np.ones((4, 32), np.int32))
