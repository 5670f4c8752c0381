"""An independent NumPy/ml_dtypes implementation of the OCP MX v1.0 spec (float64 arithmetic,
ml_dtypes' fp8 casts for element rounding), the reference of the MX quantizer and of the MXFP8
modules' recipe."""
import ml_dtypes
import numpy as np

FMT = {  # name: (ml_dtypes type, emax, max normal, canonical NaN code)
    "float8_e4m3fn": (ml_dtypes.float8_e4m3fn, 8, 448.0, 0x7F),
    "float8_e5m2": (ml_dtypes.float8_e5m2, 15, 57344.0, 0x7E),
}


def ref_to_mx(x, elem, mode, axis):
    """Spec reference: per 32-block shared exponent, scale byte, element codes, dequantized."""
    f8, emax, vmax, nan_code = FMT[elem]
    x = np.moveaxis(np.asarray(x, np.float32), axis, -1)
    n = x.shape[-1]
    nb = -(-n // 32)
    xp = np.zeros(x.shape[:-1] + (nb * 32,), np.float32)
    xp[..., :n] = x
    b = xp.reshape(x.shape[:-1] + (nb, 32)).astype(np.float64)
    finite = np.isfinite(b)
    bad = ~finite.all(-1)
    amax = np.abs(np.where(finite, b, 0.0)).max(-1)
    _, k = np.frexp(amax)                      # amax = f * 2^k, f in [0.5, 1): floor(log2) = k-1
    e = (k - 1 - emax).astype(np.float64)
    if mode == "rceil":                        # smallest e with vmax * 2^e >= amax
        e = e + (vmax * 2.0 ** e < amax)
    e = np.where(amax == 0, -127, np.clip(e, -127, 127))
    scaled = b / 2.0 ** e[..., None]
    with np.errstate(invalid="ignore"):
        codes = np.clip(np.where(finite, scaled, 0.0), -vmax, vmax).astype(f8).view(np.uint8)
    codes = np.where(bad[..., None], nan_code, codes).astype(np.uint8)
    scale = np.where(bad, 255, e + 127).astype(np.uint8)
    deq = codes.view(f8).astype(np.float64) * 2.0 ** e[..., None]
    deq = np.where(np.abs(deq) < 2.0 ** -126, deq * 0.0, deq)
    deq = np.where(bad[..., None], np.nan, deq)
    has_sub = ((b != 0) & (np.abs(b) < 2.0 ** -126)).any(-1, keepdims=True) & np.ones_like(b, bool)

    def unblock(a):
        return np.moveaxis(a.reshape(x.shape[:-1] + (nb * 32,))[..., :n], -1, axis)
    return (unblock(codes), np.moveaxis(scale, -1, axis), unblock(deq).astype(np.float32),
            unblock(has_sub))


def qd(a, axis, elem, mode):
    """Reference quantize-dequantize in float64."""
    return ref_to_mx(a.astype(np.float32), elem, mode, axis)[2].astype(np.float64)


def assert_close(got, want, tag, tol=1e-5):
    """``got`` within ``tol`` of ``want`` relative to the largest entry of ``want``."""
    err = np.abs(np.asarray(got, np.float64) - want).max() / max(np.abs(want).max(), 1e-30)
    assert err <= tol, f"{tag}: relative error {err:.2e} > {tol}"
