"""MindSpore ops backed by OpenBLAS sgemm (``ops.Custom(func_type="aot")`` with AOT backward).

The kernels live in ``blas_kernels.cpp``, compiled into their own library linked against the PyPI
package ``scipy-openblas32`` (see :mod:`..build`). :func:`blas_available` is False (reason logged once)
when that package or the compiler is missing; the functions then run ``mindspore.mint`` matmuls.

Same conventions as :mod:`..model.functional`: fp32 compute (fp16 inputs upcast, result cast back; bf16
operands go to the kernels as they are -- bf16 x bf16 with fp32 accumulation, see :mod:`.bf16`),
works in PyNative and inside ``mindspore.jit`` (availability and primitives reached through
``constexpr`` helpers, so a jit graph keeps the choice made when it was compiled).

Threads: the GEMMs use OpenBLAS's own pthread pool (MindSpore's ``threads_num`` does not apply).
OpenBLAS sizes it when loaded from ``OPENBLAS_NUM_THREADS``, else ``OMP_NUM_THREADS``, else the CPU
count -- but ``import mindspore`` does a C-level ``setenv("OMP_NUM_THREADS", "1")`` (invisible in
``os.environ``), so OpenBLAS would start single-threaded. Hence, when the primitives are created,
on first use the thread count is set explicitly to, in order: ``MS_LLM_BLAS_THREADS``, ``OPENBLAS_NUM_THREADS``
(as seen in ``os.environ``), else the number of CPUs in the process' affinity mask.
:func:`set_blas_threads` / :func:`blas_threads` change / read it at run time. ``OPENBLAS_CORETYPE``
(kernel selection of this DYNAMIC_ARCH build) is left to OpenBLAS.
"""

from __future__ import annotations

import ctypes
import logging
import os

import mindspore as ms
from mindspore import mint, ops
from mindspore.ops import constexpr

from ms_llm.compat.environment import setting

from ..build import blas_available, blas_library_path
from ..model.functional import causal_softmax

logger = logging.getLogger("ms_llm.ops.cpu_kernels")

_PRIMS: dict = {}
_THREADS: dict = {"set": False}
_TRANS = ((False, False), (False, True), (True, False), (True, True))


def _scalar_grad(x):
    return x * 0


def _cdll():
    lib = ctypes.CDLL(str(blas_library_path()))
    if not _THREADS["set"]:  # first use: replace OpenBLAS's load-time thread count (see module doc)
        _THREADS["set"] = True
        lib.MsLlmBlasSetThreads(default_blas_threads())
        from .bf16 import register_bf16_gemm
        register_bf16_gemm(lib, default_blas_threads())
    return lib


def blas_threads() -> int:
    """Threads OpenBLAS uses for the BLAS kernels (0 if unavailable)."""
    return int(_cdll().MsLlmBlasGetThreads()) if blas_available() else 0


def set_blas_threads(n: int) -> None:
    """Set OpenBLAS's thread count for the BLAS kernels (process-wide, this OpenBLAS copy only)."""
    if blas_available():
        _cdll().MsLlmBlasSetThreads(int(n))


def blas_config() -> str:
    """OpenBLAS build configuration string (core type, threading), '' if unavailable."""
    if not blas_available():
        return ""
    lib = _cdll()
    lib.MsLlmBlasConfig.restype = ctypes.c_char_p
    return lib.MsLlmBlasConfig().decode(errors="replace")


def default_blas_threads() -> int:
    """MS_LLM_BLAS_THREADS, else OPENBLAS_NUM_THREADS, else the CPUs this process may run on
    divided by the msrun workers sharing them (MS_WORKER_NUM; msrun exports no per-node count,
    so multi-node jobs should set MS_LLM_BLAS_THREADS). Oversubscribing hurts badly: 2 workers
    on 2 cores ran a 50M-model data-parallel step in 5.4 s with 2 BLAS threads each and 2.1 s
    with 1."""
    for var, val in (("runtime.blas_threads", setting("runtime.blas_threads")),
                     ("OPENBLAS_NUM_THREADS", os.environ.get("OPENBLAS_NUM_THREADS"))):
        val = "" if val is None else str(val).strip()
        if val:
            try:
                return max(1, int(val))
            except ValueError:
                logger.warning("ms_llm BLAS kernels: ignoring %s=%r (not an integer)", var, val)
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        cpus = os.cpu_count() or 1
    try:
        workers = max(1, int(os.environ.get("MS_WORKER_NUM", "1")))
    except ValueError:
        workers = 1
    return max(1, cpus // workers)


def _bmm_shape(ta, tb):
    def shape(a, b, *_):
        lead = list(a[:-2])
        m = a[-1] if ta else a[-2]
        n = b[-2] if tb else b[-1]
        return lead + [m, n]

    return shape


def _make_prims():
    path = str(blas_library_path())
    logger.info("ms_llm BLAS kernels: OpenBLAS threads=%d (%s)", blas_threads(), blas_config())

    def custom(fn, out_shape, out_dtype, bprop=None):
        return ops.Custom(f"{path}:{fn}", out_shape=out_shape, out_dtype=out_dtype, func_type="aot", bprop=bprop)

    # --- linear: (x [..., K], w [N, K]) -> y [..., N] ; bwd (x, w, dy) -> (dx, dw)
    lin_bwd = custom("LinearBwd", lambda x, w, dy: (x, w), lambda x, w, dy: (x, w))

    def lin_bprop(x, w, out, dout):
        dx, dw = lin_bwd(x, w, dout)
        return dx, dw

    lin_fwd = custom("LinearFwd", lambda x, w: list(x[:-1]) + [w[0]], lambda x, w: x, lin_bprop)

    # --- linear with bias: (x, w, b [N]) -> y ; bwd (x, w, dy) -> (dx, dw, db)
    linb_bwd = custom("LinearBiasBwd", lambda x, w, dy: (x, w, [w[0]]), lambda x, w, dy: (x, w, w))

    def linb_bprop(x, w, b, out, dout):
        dx, dw, db = linb_bwd(x, w, dout)
        return dx, dw, db

    linb_fwd = custom("LinearBiasFwd", lambda x, w, b: list(x[:-1]) + [w[0]], lambda x, w, b: x, linb_bprop)

    prims = {"linear": lin_fwd, "linear_bias": linb_fwd, "linear_bwd": lin_bwd}

    # --- bmm: (a, b, ta, tb) -> c ; bwd (a, b, dc, ta, tb) -> (da, db). One forward primitive per
    #     transpose combination (the output shape depends on it); the flags also reach the kernel.
    bmm_bwd = custom("BmmBwd", lambda a, b, dc, ta, tb: (a, b), lambda a, b, dc, ta, tb: (a, b))

    def bmm_bprop(a, b, ta, tb, out, dout):
        da, db = bmm_bwd(a, b, dout, ta, tb)
        return da, db, _scalar_grad(ta), _scalar_grad(tb)

    for ta, tb in _TRANS:
        prims[f"bmm{int(ta)}{int(tb)}"] = custom("BmmFwd", _bmm_shape(ta, tb), lambda a, b, ta_, tb_: a, bmm_bprop)

    # --- causal attention (blas_attention.cpp): (q [.., R*S, D], k, v [.., S, D], scale)
    #     -> (o, probs [.., R*S, S]) ; bwd (q, k, v, probs, do, scale) -> (dq, dk, dv)
    attn_bwd = custom("CausalAttnBwd", lambda q, k, v, p, do, sc: (q, k, v),
                      lambda q, k, v, p, do, sc: (q, k, v))

    def attn_bprop(q, k, v, scale, out, dout):
        dq, dk, dv = attn_bwd(q, k, v, out[1], dout[0], scale)
        return dq, dk, dv, _scalar_grad(scale)

    prims["causal_attention"] = custom(
        "CausalAttnFwd", lambda q, k, v, sc: (q, list(q[:-1]) + [k[-2]]),
        lambda q, k, v, sc: (q, q), attn_bprop)

    # --- one blockwise-attention pair (blas_pair_attention.cpp), no autograd (the caller's
    #     Function runs the backward): (q, k, v, bias, scale) -> (o, lse) ;
    #     (q, k, v, do, delta, lse, bias, scale) -> (dq, dk, dv)
    prims["pair_attention"] = custom("PairAttnFwd", lambda q, k, v, b, sc: (q, list(q[:-1])),
                                     lambda q, k, v, b, sc: (q, q))
    prims["pair_attention_grads"] = custom(
        "PairAttnBwd", lambda q, k, v, do, dl, lse, b, sc: (q, k, v),
        lambda q, k, v, do, dl, lse, b, sc: (q, k, v))
    return prims


def _ensure_prims():
    if not blas_available():
        return False
    if not _PRIMS:
        _PRIMS.update(_make_prims())
    return True


@constexpr
def _blas_enabled():
    return _ensure_prims()


@constexpr
def _prim(name):
    return _PRIMS[name]


@constexpr
def _bmm_name(ta, tb):
    return f"bmm{int(bool(ta))}{int(bool(tb))}"


def _f32(t):
    return t if t.dtype == ms.float32 else t.astype(ms.float32)


@constexpr
def _native_dtypes(*dtypes):
    """True when the kernels take these operands as they are: all fp32, or all bf16 (widened to
    fp32 inside the kernel, or multiplied by the registered bf16 GEMM; fp32 accumulation)."""
    return all(d == ms.float32 for d in dtypes) or all(d == ms.bfloat16 for d in dtypes)


def linear(x, weight, bias=None):
    """``x @ weight.T (+ bias)``: x [..., K], weight [N, K], bias [N] or None -> [..., N].

    OpenBLAS sgemm forward and backward (dx = dy W, dW = dy^T x, db = column sums of dy), grads for
    x, weight and bias. Falls back to ``mint.nn.functional.linear`` when :func:`blas_available` is False.
    """
    if not _blas_enabled():
        return mint.nn.functional.linear(x, weight, bias)
    dt = x.dtype
    if bias is None and _native_dtypes(dt, weight.dtype):   # fp32, or bf16 in and out
        return _prim("linear")(x, weight)
    if bias is not None and _native_dtypes(dt, weight.dtype, bias.dtype):
        return _prim("linear_bias")(x, weight, bias)
    if bias is None:
        y = _prim("linear")(_f32(x), _f32(weight))
    else:
        y = _prim("linear_bias")(_f32(x), _f32(weight), _f32(bias))
    return y if dt == ms.float32 else y.astype(dt)


def linear_fp32(x, weight):
    """``x @ weight.T`` of fp32 x [M, K], weight [N, K] through the same kernel as :func:`linear`,
    for custom backward functions (a ``Cell.bprop`` under ``mindspore.jit`` must not call the
    function graphs its forward calls: MindSpore 2.10 raises "The func graph is empty")."""
    if not _blas_enabled():
        return mint.nn.functional.linear(x, weight)
    return _prim("linear")(x, weight)


def linear_grad(x, weight, dy):
    """``(dx, dw) = (dy @ weight, dy^T @ x)`` of ``y = x @ weight.T`` for x [M, K], weight [N, K],
    dy [M, N], all fp32: the backward kernel of :func:`linear`, for ops that run their own backward
    (the chunked output layer + cross entropy). Falls back to ``mint.matmul``."""
    if not _blas_enabled():
        return mint.matmul(dy, weight), mint.matmul(dy.swapaxes(0, 1), x)
    return _prim("linear_bwd")(x, weight, dy)


def bmm(a, b, transpose_a=False, transpose_b=False):
    """Batched ``op(a) @ op(b)`` over identical leading dims (no broadcasting), op = transpose of the
    last two axes when the flag is set: a [..., M, K] (or [..., K, M]), b [..., K, N] (or [..., N, K])
    -> [..., M, N]. Grads for a and b. Falls back to ``mint.matmul`` when BLAS is unavailable."""
    if not _blas_enabled():
        aa = a.swapaxes(-1, -2) if transpose_a else a
        bb = b.swapaxes(-1, -2) if transpose_b else b
        return mint.matmul(aa, bb)
    dt = a.dtype
    prim = _prim(_bmm_name(transpose_a, transpose_b))
    if _native_dtypes(dt, b.dtype):   # fp32, or bf16 in and out
        return prim(a, b, int(bool(transpose_a)), int(bool(transpose_b)))
    c = prim(_f32(a), _f32(b), int(bool(transpose_a)), int(bool(transpose_b)))
    return c if dt == ms.float32 else c.astype(dt)


def causal_attention(q, k, v, scale: float):
    """Causal softmax attention in the grouped layout: q [..., R*S, D] (rows ``h*S + i``: the R query
    heads of one KV group), k, v [..., S, D], fp32 -> [..., R*S, D]. Query blocks skip the keys the
    causal mask hides, in forward and backward (``blas_attention.cpp``); grads for q, k and v.
    Without BLAS: the full product, masked by the (AOT or composed) causal softmax."""
    if not _blas_enabled():
        r = q.shape[-2] // k.shape[-2]
        lead, s = tuple(q.shape[:-2]), k.shape[-2]
        scores = mint.matmul(q, k.swapaxes(-1, -2)).reshape(lead + (r, s, s))
        probs = causal_softmax(scores, scale).reshape(lead + (r * s, s))
        return mint.matmul(probs, v)
    return _prim("causal_attention")(q, k, v, float(scale))[0]


_NO_MASK: dict = {}


def _no_mask():
    """The bias operand meaning "no mask" (any shape other than [NB, C, K])."""
    if not _NO_MASK:
        _NO_MASK["t"] = ms.Tensor([0.0], ms.float32)
    return _NO_MASK["t"]


def pair_attention(q, k, v, bias, scale: float):
    """Softmax attention of one (query chunk, key block) pair in the grouped layout, fp32:
    q [B, G, R*C, D] (rows ``h*C + i``), k, v [B, G, K, D], ``bias`` an additive mask
    [NB, C, K] (NB 1 or B) or None -> (normalised out [B, G, R*C, D], lse [B, G, R*C]).
    ``blas_pair_attention.cpp``; None when the BLAS kernels are unavailable (the caller composes).
    No autograd: :func:`pair_attention_grads` is the backward."""
    if not _ensure_prims():
        return None
    o, lse = _PRIMS["pair_attention"](q, k, v, _no_mask() if bias is None else bias, float(scale))
    return o, lse


def pair_attention_grads(q, k, v, dout, delta, lse, bias, scale: float):
    """``(dq, dk, dv)`` of one pair given the merged output's ``lse`` and ``delta = rowsum(dout *
    out)`` (both [B, G, R*C]), operands as :func:`pair_attention`; None without the kernels."""
    if not _ensure_prims():
        return None
    return tuple(_PRIMS["pair_attention_grads"](q, k, v, dout, delta, lse,
                                                _no_mask() if bias is None else bias,
                                                float(scale)))
