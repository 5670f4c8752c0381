"""ms_llm.ops hot ops against independent float64 NumPy implementations, forward and gradient.

Every op is tested twice: the dispatched function (whatever path is active on this machine:
"aot" C++ kernels or "composed" on CPU, "native" on Ascend) and its ``*_composed`` variant.
Gradients are taken with ``mindspore.grad`` w.r.t. the inputs of ``sum(op(...) * G)`` for a
random upstream weighting ``G``; the NumPy references carry hand-written backward passes, which
are themselves checked against float64 finite differences (test_reference_backward_vs_fd).

Tolerances: all ops compute in fp32. Against a float64 reference that is ~1e-6 relative per
rounding chain; MindSpore 2.10's CPU ``exp`` has ~5e-6 relative error (measured), so anything
through exp/softmax/rsqrt gets rtol 1e-5 plus an absolute floor of 1e-5 x max|ref| for entries
that are near zero by cancellation (``assert_close`` below). Low-precision outputs add the
output rounding: unit roundoff u = 2^-8 (bf16) or 2^-11 (fp16) relative.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor

from ms_llm.ops import apply_rope, causal_attention, cross_entropy, rms_norm, rope_cos_sin, swiglu
from ms_llm.ops._dispatch import path_for
from ms_llm.ops.attention import causal_attention_composed
from ms_llm.ops.cross_entropy import cross_entropy_composed
from ms_llm.ops.rms_norm import rms_norm_composed
from ms_llm.ops.rope import apply_rope_composed
from ms_llm.ops.swiglu import swiglu_composed

RTOL = 1e-5      # fp32 compute incl. CPU exp (~5e-6 relative)
ATOL_REL = 1e-5  # absolute floor, relative to max|ref|, for entries near zero by cancellation
U = {ms.bfloat16: 2.0 ** -8, ms.float16: 2.0 ** -11}
NP_LOW = {ms.bfloat16: ml_dtypes.bfloat16, ms.float16: np.float16}


def assert_close(got, ref, rtol=RTOL, atol_rel=ATOL_REL, what=""):
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    assert np.all(np.isfinite(got)), what
    bound = rtol * np.abs(ref) + atol_rel * max(np.abs(ref).max(), 1e-30)
    err = np.abs(got - ref)
    i = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), \
        f"{what}: worst at {i}: got {got[i]}, expected {ref[i]} (|err| {err[i]:.3g} > {bound[i]:.3g})"


def rnd(seed, *shape, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def round_to(a, dt):
    """Round fp32 NumPy values to the low-precision dtype ``dt`` and widen back (exact)."""
    return np.asarray(a, np.float32).astype(NP_LOW[dt]).astype(np.float32)


def low_tensor(a, dt):
    return Tensor(round_to(a, dt)).astype(dt)


def to_np(t: Tensor) -> np.ndarray:
    return t.astype(ms.float32).asnumpy() if t.dtype == ms.bfloat16 else t.asnumpy()


def value_and_grads(fn, inputs, G, grad_position):
    """out = fn(*inputs); grads of sum(out * G) w.r.t. inputs[grad_position]."""
    Gt = Tensor(G)
    vg = ms.value_and_grad(lambda *xs: (fn(*xs) * Gt).sum(), grad_position=grad_position)
    _, grads = vg(*inputs)
    grads = grads if isinstance(grads, tuple) else (grads,)
    return fn(*inputs).asnumpy(), [g.asnumpy() for g in grads]


# ============================================================================ NumPy references
def np_rms_norm(x, w, eps, G):
    x, w, G = (a.astype(np.float64) for a in (x, w, G))
    n = x.shape[-1]
    r = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    y = x * r * w
    gw = G * w
    dx = r * gw - x * r ** 3 * (gw * x).sum(-1, keepdims=True) / n
    dw = (G * x * r).reshape(-1, n).sum(0)
    return y, dx, dw


def np_swiglu(x, G):
    x, G = x.astype(np.float64), G.astype(np.float64)
    a, b = np.split(x, 2, -1)
    sig = 1.0 / (1.0 + np.exp(-a))
    y = a * sig * b
    da = G * b * sig * (1.0 + a * (1.0 - sig))
    db = G * a * sig
    return y, np.concatenate([da, db], -1)


def np_rope_angles(s, d, base, offset=0):
    """[s, d/2] angles pos * base^(-2i/d), computed from scratch."""
    i = np.arange(d // 2, dtype=np.float64)
    theta = np.power(float(base), -2.0 * i / d)
    pos = np.arange(offset, offset + s, dtype=np.float64)
    return pos[:, None] * theta[None, :]


def np_rope(x, base, G, offset=0):
    """Rotate-half RoPE: pair (i, i + d/2) rotated by angle pos * theta_i; x [..., s, d]."""
    x, G = x.astype(np.float64), G.astype(np.float64)
    s, d = x.shape[-2:]
    ang = np_rope_angles(s, d, base, offset)
    c, sn = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    y = np.concatenate([x1 * c - x2 * sn, x2 * c + x1 * sn], -1)
    g1, g2 = G[..., : d // 2], G[..., d // 2:]
    dx = np.concatenate([g1 * c + g2 * sn, g2 * c - g1 * sn], -1)     # rotation by -angle
    return y, dx


def np_attention(q, k, v, scale, mask, G):
    """q [b,nh,s,d], k/v [b,ng,s,d]; mask bool [b|1,1,s,s] True = masked (None -> causal)."""
    q, k, v, G = (a.astype(np.float64) for a in (q, k, v, G))
    b, nh, s, d = q.shape
    ng = k.shape[1]
    rep = nh // ng
    kh, vh = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)   # head h reads group h // rep
    S = q @ kh.swapaxes(-1, -2) * scale
    if mask is None:
        mask = np.triu(np.ones((s, s), bool), 1)[None, None]
    mask = np.broadcast_to(mask, (b, 1, s, s))
    assert not mask.all(-1).any(), "reference needs at least one visible key per row"
    S = np.where(mask, -np.inf, S)
    P = np.exp(S - S.max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)
    out = P @ vh
    dP = G @ vh.swapaxes(-1, -2)
    dS = P * (dP - (dP * P).sum(-1, keepdims=True))
    dq = dS @ kh * scale
    dkh = dS.swapaxes(-1, -2) @ q * scale
    dvh = P.swapaxes(-1, -2) @ G
    dk = dkh.reshape(b, ng, rep, s, d).sum(2)
    dv = dvh.reshape(b, ng, rep, s, d).sum(2)
    return out, dq, dk, dv


def np_cross_entropy(z, labels, G, ignore=-100):
    z, G = z.astype(np.float64), G.astype(np.float64)
    valid = labels != ignore
    safe = np.where(valid, labels, 0)
    m = z.max(-1, keepdims=True)
    lse = m[..., 0] + np.log(np.exp(z - m).sum(-1))
    picked = np.take_along_axis(z, safe[..., None], -1)[..., 0]
    loss = np.where(valid, lse - picked, 0.0)
    p = np.exp(z - lse[..., None])
    onehot = np.eye(z.shape[-1])[safe]
    dz = np.where(valid[..., None], G[..., None] * (p - onehot), 0.0)
    return loss, dz


def _fd(f, x, eps=1e-6):
    """Central finite differences of scalar f at float64 x."""
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        xp, xm = x.copy(), x.copy()
        xp[i] += eps
        xm[i] -= eps
        g[i] = (f(xp) - f(xm)) / (2 * eps)
    return g


def test_reference_backward_vs_fd():
    """The hand-written NumPy backward passes agree with finite differences (float64, 1e-6)."""
    r = np.random.default_rng(0)
    x, w, G = r.standard_normal((2, 6)), r.standard_normal(6), r.standard_normal((2, 6))
    _, dx, dw = np_rms_norm(x, w, 1e-6, G)
    np.testing.assert_allclose(dx, _fd(lambda t: (np_rms_norm(t, w, 1e-6, G)[0] * G).sum(), x), atol=1e-6)
    np.testing.assert_allclose(dw, _fd(lambda t: (np_rms_norm(x, t, 1e-6, G)[0] * G).sum(), w), atol=1e-6)

    x, G = r.standard_normal((3, 8)), r.standard_normal((3, 4))
    np.testing.assert_allclose(np_swiglu(x, G)[1], _fd(lambda t: (np_swiglu(t, G)[0] * G).sum(), x), atol=1e-6)

    x, G = r.standard_normal((2, 5, 8)), r.standard_normal((2, 5, 8))
    np.testing.assert_allclose(np_rope(x, 1e4, G)[1], _fd(lambda t: (np_rope(t, 1e4, G)[0] * G).sum(), x),
                               atol=1e-6)

    q, k, v = r.standard_normal((1, 4, 5, 3)), r.standard_normal((1, 2, 5, 3)), r.standard_normal((1, 2, 5, 3))
    G = r.standard_normal((1, 4, 5, 3))
    mask = r.random((1, 1, 5, 5)) < 0.4
    mask[..., np.arange(5), np.arange(5)] = False
    for m in (None, mask):
        _, dq, dk, dv = np_attention(q, k, v, 0.7, m, G)
        f = lambda q_, k_, v_: (np_attention(q_, k_, v_, 0.7, m, G)[0] * G).sum()  # noqa: E731
        np.testing.assert_allclose(dq, _fd(lambda t: f(t, k, v), q), atol=1e-6)
        np.testing.assert_allclose(dk, _fd(lambda t: f(q, t, v), k), atol=1e-6)
        np.testing.assert_allclose(dv, _fd(lambda t: f(q, k, t), v), atol=1e-6)

    z, G = r.standard_normal((2, 3, 7)), r.standard_normal((2, 3))
    labels = np.array([[1, -100, 6], [0, 3, -100]])
    np.testing.assert_allclose(np_cross_entropy(z, labels, G)[1],
                               _fd(lambda t: (np_cross_entropy(t, labels, G)[0] * G).sum(), z), atol=1e-6)


def test_active_path_is_known():
    for op in ("rms_norm", "swiglu", "rope", "attention", "cross_entropy"):
        assert path_for(op) in ("aot", "composed") if ms.get_context("device_target") == "CPU" \
            else path_for(op) == "native"


# ============================================================================ RMSNorm
RMS = {"dispatched": rms_norm, "composed": rms_norm_composed}


@pytest.mark.parametrize("impl", list(RMS))
@pytest.mark.parametrize("shape,eps", [((2, 5, 96), 1e-6), ((7, 33), 1e-5)])
def test_rms_norm_fp32(impl, shape, eps):
    H = shape[-1]
    x, w, G = rnd(1, *shape), 1.0 + rnd(2, H, scale=0.1), rnd(3, *shape)
    fn = lambda x_, w_: RMS[impl](x_, w_, eps)  # noqa: E731
    out, (dx, dw) = value_and_grads(fn, (Tensor(x), Tensor(w)), G, (0, 1))
    y_ref, dx_ref, dw_ref = np_rms_norm(x, w, eps, G)
    assert_close(out, y_ref, what="rms_norm y")
    assert_close(dx, dx_ref, what="rms_norm dx")
    assert_close(dw, dw_ref, what="rms_norm dw")


def test_rms_norm_eps_matters():
    # tiny-magnitude rows: eps dominates, so a dropped/misplaced eps shows up
    x = rnd(4, 3, 96, scale=1e-3)
    w = np.ones(96, np.float32)
    for impl in RMS.values():
        y = impl(Tensor(x), Tensor(w), 1e-5).asnumpy()
        assert_close(y, np_rms_norm(x, w, 1e-5, x)[0], what="rms_norm eps")


@pytest.mark.parametrize("impl", list(RMS))
@pytest.mark.parametrize("dt", [ms.bfloat16, ms.float16])
def test_rms_norm_low_precision(impl, dt):
    x = round_to(rnd(5, 4, 96, scale=2.0), dt)
    w = round_to(1.0 + rnd(6, 96, scale=0.1), dt)
    y = RMS[impl](low_tensor(x, dt), low_tensor(w, dt), 1e-6)
    assert y.dtype == dt
    # computed in fp32, rounded once to dt: u relative (+ fp32 error)
    assert_close(to_np(y), np_rms_norm(x, w, 1e-6, x)[0], rtol=U[dt] + RTOL, what=f"rms_norm {dt}")
    y = RMS[impl](low_tensor(x, dt), Tensor(w), 1e-6)                 # fp32 weight, dt input
    assert y.dtype == dt
    assert_close(to_np(y), np_rms_norm(x, w, 1e-6, x)[0], rtol=U[dt] + RTOL, what=f"rms_norm {dt}/fp32 w")


# ============================================================================ SwiGLU
SWIGLU = {"dispatched": swiglu, "composed": swiglu_composed}


@pytest.mark.parametrize("impl", list(SWIGLU))
@pytest.mark.parametrize("shape", [(2, 5, 2 * 96), (3, 2 * 257)])
def test_swiglu_fp32(impl, shape):
    x = rnd(7, *shape, scale=2.0)
    G = rnd(8, *shape[:-1], shape[-1] // 2)
    out, (dx,) = value_and_grads(SWIGLU[impl], (Tensor(x),), G, 0)
    y_ref, dx_ref = np_swiglu(x, G)
    assert_close(out, y_ref, what="swiglu y")
    assert_close(dx, dx_ref, what="swiglu dx")


@pytest.mark.parametrize("impl", list(SWIGLU))
@pytest.mark.parametrize("dt", [ms.bfloat16, ms.float16])
def test_swiglu_low_precision(impl, dt):
    x = round_to(rnd(9, 4, 2 * 96, scale=2.0), dt)
    y = SWIGLU[impl](low_tensor(x, dt))
    assert y.dtype == dt
    u = U[dt]
    composed = impl == "composed" or path_for("swiglu") == "composed"
    if composed and dt == ms.float16:
        # F.silu upcasts only bf16, so fp16 runs MindSpore's native fp16 silu kernel: measured
        # <= 2.05 ulp (<= 4.1u relative) on [-8, 8], then one rounding of the product: 5.5u.
        rtol = 5.5 * u
    else:
        # silu computed in fp32; up to two roundings to dt (silu(gate) is rounded before the
        # multiply in the composed form): 2u + u^2 relative, plus fp32 error
        rtol = 2 * u + u * u + RTOL
    assert_close(to_np(y), np_swiglu(x, x[..., :96])[0], rtol=rtol, what=f"swiglu {dt}")


# ============================================================================ RoPE
ROPE = {"dispatched": apply_rope, "composed": apply_rope_composed}


@pytest.mark.parametrize("base", [1e4, 1e6])
@pytest.mark.parametrize("d", [32, 64])
def test_rope_cos_sin_table(base, d):
    s, off = 64, 100
    cos, sin = rope_cos_sin(s, d, base)
    assert cos.dtype == ms.float32 and cos.shape == (s, d) and sin.shape == (s, d)
    ang = np_rope_angles(s, d, base)
    full = np.concatenate([ang, ang], -1)
    # fp32 rounding of values in [-1, 1]: <= 6e-8
    np.testing.assert_allclose(cos.asnumpy(), np.cos(full), rtol=0, atol=1e-7)
    np.testing.assert_allclose(sin.asnumpy(), np.sin(full), rtol=0, atol=1e-7)
    cos_o, sin_o = rope_cos_sin(s, d, base, position_offset=off)
    ang_o = np.concatenate([np_rope_angles(s, d, base, off)] * 2, -1)
    np.testing.assert_allclose(cos_o.asnumpy(), np.cos(ang_o), rtol=0, atol=1e-7)
    np.testing.assert_allclose(sin_o.asnumpy(), np.sin(ang_o), rtol=0, atol=1e-7)


@pytest.mark.parametrize("impl", list(ROPE))
@pytest.mark.parametrize("base,shape", [(1e6, (2, 4, 64, 64)), (1e4, (2, 3, 64, 32)), (1e6, (3, 64, 16))])
def test_rope_fp32(impl, base, shape):
    """s = 64 positions and base 1e6: a wrong exponent (2i/d vs i/d), wrong pairing (interleaved
    vs rotate-half) or a sin sign error shows up at large positions."""
    s, d = shape[-2:]
    x, G = rnd(10, *shape), rnd(11, *shape)
    cos, sin = rope_cos_sin(s, d, base)
    fn = lambda x_: ROPE[impl](x_, cos, sin)  # noqa: E731
    out, (dx,) = value_and_grads(fn, (Tensor(x),), G, 0)
    y_ref, dx_ref = np_rope(x, base, G)
    # a rotation: one fp32 rounding of the cos/sin table (6e-8) and of two products -> 1e-6 x max
    assert_close(out, y_ref, rtol=1e-6, atol_rel=1e-6, what="rope y")
    assert_close(dx, dx_ref, rtol=1e-6, atol_rel=1e-6, what="rope dx")


@pytest.mark.parametrize("impl", list(ROPE))
def test_rope_position_offset(impl):
    """Decoding positions 40..63 with an offset table equals rows 40..63 of the full rotation."""
    x = rnd(12, 1, 2, 64, 32)
    cos, sin = rope_cos_sin(24, 32, 1e6, position_offset=40)
    y = ROPE[impl](Tensor(x[:, :, 40:]), cos, sin).asnumpy()
    assert_close(y, np_rope(x, 1e6, x)[0][:, :, 40:], rtol=1e-6, atol_rel=1e-6, what="rope offset")


@pytest.mark.parametrize("impl", list(ROPE))
@pytest.mark.parametrize("dt", [ms.bfloat16, ms.float16])
def test_rope_low_precision(impl, dt):
    x = round_to(rnd(13, 2, 4, 64, 64), dt)
    cos, sin = rope_cos_sin(64, 64, 1e6)
    y = ROPE[impl](low_tensor(x, dt), cos, sin)
    assert y.dtype == dt
    # computed in fp32, rounded once: u relative, plus 1e-6 x max for the fp32 part
    assert_close(to_np(y), np_rope(x, 1e6, x)[0], rtol=U[dt], atol_rel=1e-6, what=f"rope {dt}")


# ============================================================================ attention
def _attn(impl):
    if impl == "dispatched":
        return causal_attention
    return lambda q, k, v, scale=None, attention_mask=None: causal_attention_composed(
        q, k, v, 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale, attention_mask)


def _packed_mask(doc_lengths, causal=True):
    """Block-diagonal packed-document mask, True = masked (Megatron convention)."""
    s = sum(doc_lengths)
    doc = np.repeat(np.arange(len(doc_lengths)), doc_lengths)
    visible = doc[:, None] == doc[None, :]
    if causal:
        visible &= np.tril(np.ones((s, s), bool))
    return ~visible


def _run_attention(impl, b, nh, ng, s, d, scale=None, mask=None, seed=20):
    q, k, v = rnd(seed, b, nh, s, d), rnd(seed + 1, b, ng, s, d), rnd(seed + 2, b, ng, s, d)
    G = rnd(seed + 3, b, nh, s, d)
    fn = _attn(impl)
    mt = None if mask is None else Tensor(mask)
    f = lambda q_, k_, v_: fn(q_, k_, v_, scale=scale, attention_mask=mt)  # noqa: E731
    out, (dq, dk, dv) = value_and_grads(f, (Tensor(q), Tensor(k), Tensor(v)), G, (0, 1, 2))
    ref_scale = 1.0 / math.sqrt(d) if scale is None else scale
    o_ref, dq_ref, dk_ref, dv_ref = np_attention(q, k, v, ref_scale, mask, G)
    assert_close(out, o_ref, what="attention out")
    assert_close(dq, dq_ref, what="attention dq")
    assert_close(dk, dk_ref, what="attention dk")
    assert_close(dv, dv_ref, what="attention dv")


@pytest.mark.parametrize("impl", ["dispatched", "composed"])
@pytest.mark.parametrize("nh,ng", [(4, 4), (8, 2), (4, 1)], ids=["MHA", "GQA", "MQA"])
def test_causal_attention(impl, nh, ng):
    _run_attention(impl, b=2, nh=nh, ng=ng, s=16, d=16)


@pytest.mark.parametrize("impl", ["dispatched", "composed"])
def test_causal_attention_custom_scale_odd_sizes(impl):
    _run_attention(impl, b=1, nh=6, ng=3, s=13, d=24, scale=0.3, seed=30)


@pytest.mark.parametrize("impl", ["dispatched", "composed"])
def test_attention_packed_document_mask(impl):
    # per-batch masks [b, 1, s, s]: different document boundaries in each row of the batch
    mask = np.stack([_packed_mask([5, 7, 4]), _packed_mask([9, 7])])[:, None]
    _run_attention(impl, b=2, nh=8, ng=2, s=16, d=16, mask=mask, seed=40)
    # one mask broadcast over the batch [1, 1, s, s]
    _run_attention(impl, b=2, nh=4, ng=1, s=16, d=16, mask=_packed_mask([3, 3, 10])[None, None], seed=50)


@pytest.mark.parametrize("impl", ["dispatched", "composed"])
def test_attention_mask_replaces_causal(impl):
    """The explicit mask is used *instead of* the causal mask: a bidirectional block-diagonal
    mask lets a token see later tokens of its own document."""
    mask = _packed_mask([6, 10], causal=False)[None, None]
    _run_attention(impl, b=1, nh=4, ng=2, s=16, d=8, mask=mask, seed=60)


@pytest.mark.parametrize("impl", ["dispatched", "composed"])
def test_attention_fully_masked_row_is_uniform(impl):
    """Documented in ops/attention.py: the finite mask value gives a fully masked row a uniform
    softmax (mean of V over all keys), never NaN."""
    b, nh, ng, s, d = 1, 2, 1, 6, 4
    q, k, v = rnd(70, b, nh, s, d), rnd(71, b, ng, s, d), rnd(72, b, ng, s, d)
    mask = _packed_mask([6])
    mask[2, :] = True
    out = _attn(impl)(Tensor(q), Tensor(k), Tensor(v), attention_mask=Tensor(mask[None, None])).asnumpy()
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out[0, :, 2], np.broadcast_to(v[0, 0].mean(0), (nh, d)), rtol=1e-5, atol=1e-6)


# ============================================================================ cross entropy
def _ce(impl):
    if impl == "dispatched":
        return cross_entropy
    # called the way cross_entropy calls it: 2-D fp32 logits, 1-D labels (it does not upcast
    # bf16 itself: F.where has no bf16 CPU kernel)
    return lambda z, y: cross_entropy_composed(z.reshape(-1, z.shape[-1]).astype(ms.float32),
                                               y.reshape(-1)).reshape(y.shape)


@pytest.mark.parametrize("impl", ["dispatched", "composed"])
@pytest.mark.parametrize("label_dtype", [np.int64, np.int32])
@pytest.mark.parametrize("offset", [0.0, 100.0])
def test_cross_entropy(impl, label_dtype, offset):
    b, s, V = 2, 9, 257
    z = rnd(80, b, s, V, scale=3.0) + np.float32(offset)   # +100: stability (no exp overflow)
    labels = np.random.default_rng(81).integers(0, V, (b, s)).astype(label_dtype)
    labels[0, [1, 4]] = -100
    labels[1, 8] = -100
    labels[1, 0], labels[1, 1] = 0, V - 1                   # edge classes
    G = rnd(82, b, s)
    fn = _ce(impl)
    loss = fn(Tensor(z), Tensor(labels))
    assert loss.dtype == ms.float32 and loss.shape == (b, s)
    Gt = Tensor(G)
    dz = ms.grad(lambda z_: (fn(z_, Tensor(labels)) * Gt).sum())(Tensor(z)).asnumpy()
    loss_ref, dz_ref = np_cross_entropy(z, labels, G)
    # loss ~ lse - z_y with |z| up to ~110: fp32 rounding of lse is ~ulp(110) = 7.6e-6 -> 3e-5 abs
    assert_close(loss.asnumpy(), loss_ref, rtol=RTOL, atol_rel=3e-5 / np.abs(loss_ref).max(), what="ce loss")
    assert_close(dz, dz_ref, what="ce dz")
    ignored = labels == -100
    assert np.all(loss.asnumpy()[ignored] == 0.0)           # exactly 0 at ignored positions
    assert np.all(dz[ignored] == 0.0)                       # and exactly zero gradient


@pytest.mark.parametrize("impl", ["dispatched", "composed"])
def test_cross_entropy_all_ignored_and_bf16_logits(impl):
    z = rnd(83, 3, 257)
    labels = np.full(3, -100, np.int64)
    fn = _ce(impl)
    loss = fn(Tensor(z), Tensor(labels)).asnumpy()
    dz = ms.grad(lambda z_: fn(z_, Tensor(labels)).sum())(Tensor(z)).asnumpy()
    assert np.all(loss == 0.0) and np.all(dz == 0.0)
    # bf16 logits are computed in fp32; the loss comes back fp32
    zb = round_to(z, ms.bfloat16)
    labels = np.array([5, -100, 256], np.int64)
    loss = fn(low_tensor(zb, ms.bfloat16), Tensor(labels))
    assert loss.dtype == ms.float32
    assert_close(loss.asnumpy(), np_cross_entropy(zb, labels, np.ones(3))[0], what="ce bf16 logits")
