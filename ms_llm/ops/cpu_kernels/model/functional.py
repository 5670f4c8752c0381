"""MindSpore ops backed by the AOT C++ kernels (``ops.Custom(func_type="aot")`` with AOT backward).

Each public function computes in fp32 (fp16 inputs are upcast and the result is cast back to the
input dtype; bf16 tensors go to rms_norm, swiglu and rope as they are -- the kernels widen on load
and round on store -- and cross_entropy always returns fp32) and falls back to the composed form in
:mod:`.composed` when :func:`available` is False.

They work in PyNative and inside ``mindspore.jit`` (default AST capture): the availability check and
the Custom primitives are reached through ``constexpr`` helpers, so under jit they are evaluated once
at compile time (building the library if needed) and the graph holds the primitives as constants.
Consequence: a jit graph compiled while the kernels were available keeps using them even if
MS_LLM_DISABLE_AOT is set later in the same process.

Scalar arguments (eps, scale, ignore_index, seq_dim) must be Python numbers (compile-time constants
under jit); they reach the C++ code as 0-d tensors.

Gradients: rms_norm -> x, weight; swiglu -> x; cross_entropy -> logits; rope -> x (cos/sin are treated
as constants and get zero gradient); causal_softmax -> scores.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import ops
from mindspore.ops import constexpr

from . import composed
from ..build import available, library_path

_PRIMS: dict = {}


def _same(*shapes_or_types):
    return shapes_or_types[0]


def _swiglu_shape(x):
    return list(x[:-1]) + [x[-1] // 2]


def _rows(shape) -> int:
    """Rows of a [..., V] shape (the product of its leading dims)."""
    n = 1
    for s in shape[:-1]:
        n *= s
    return n


def _zeros_like(x):
    return ops.zeros_like(x)


def _scalar_grad(x):
    """Gradient slot for a Python scalar input (eps, scale, ignore_index, seq_dim)."""
    return x * 0


def _make_prims():
    """Create every Custom primitive once (forward + backward pairs)."""
    path = str(library_path())

    def custom(fn, out_shape, out_dtype, bprop=None):
        return ops.Custom(f"{path}:{fn}", out_shape=out_shape, out_dtype=out_dtype, func_type="aot", bprop=bprop)

    # --- RMSNorm: (x, w, eps) -> y ; bwd (x, w, dy, eps) -> (dx, dw)
    rms_bwd = custom("RmsNormBwd", lambda x, w, dy, eps: (x, w), lambda x, w, dy, eps: (x, w))

    def rms_bprop(x, w, eps, out, dout):
        dx, dw = rms_bwd(x, w, dout, eps)
        return dx, dw, _scalar_grad(eps)

    rms_fwd = custom("RmsNormFwd", lambda x, w, eps: x, lambda x, w, eps: x, rms_bprop)

    # --- SwiGLU: (x [..., 2F]) -> y [..., F] ; bwd (x, dy) -> dx
    swiglu_bwd = custom("SwigluBwd", lambda x, dy: x, lambda x, dy: x)

    def swiglu_bprop(x, out, dout):
        return (swiglu_bwd(x, dout),)

    swiglu_fwd = custom("SwigluFwd", _swiglu_shape, _same, swiglu_bprop)

    # --- Cross entropy: (logits [N, V], labels [N], ignore) -> (loss [N], lse [N])
    #     bwd (logits, labels, lse, dloss, ignore) -> dlogits
    ce_bwd = custom("CrossEntropyBwd", lambda x, lab, lse, dl, ign: x, lambda x, lab, lse, dl, ign: x)

    def ce_bprop(logits, labels, ignore_index, out, dout):
        dlogits = ce_bwd(logits, labels, out[1], dout[0], ignore_index)
        return dlogits, _zeros_like(labels), _scalar_grad(ignore_index)

    # logits may be [..., V] (rows: every leading index): a reshape to [N, V] would copy the
    # whole tensor in PyNative (~20 ms at 2048 x 32000 fp32, and again for its gradient).
    ce_fwd = custom(
        "CrossEntropyFwd",
        lambda x, lab, ign: ([_rows(x)], [_rows(x)]),
        lambda x, lab, ign: (ms.float32, ms.float32),   # loss and lse fp32 for bf16 logits too
        ce_bprop,
    )

    # --- Causal softmax: (scores, scale) -> y ; bwd (y, dy, scale) -> dx
    cs_bwd = custom("CausalSoftmaxBwd", lambda y, dy, sc: y, lambda y, dy, sc: y)

    def cs_bprop(x, scale, out, dout):
        return cs_bwd(out, dout, scale), _scalar_grad(scale)

    cs_fwd = custom("CausalSoftmaxFwd", lambda x, sc: x, lambda x, sc: x, cs_bprop)

    # --- RoPE: (x, cos, sin, seq_dim) -> y ; bwd (dy, cos, sin, seq_dim) -> dx
    rope_bwd = custom("RopeBwd", lambda g, c, s, d: g, lambda g, c, s, d: g)

    def rope_bprop(x, cos, sin, seq_dim, out, dout):
        return rope_bwd(dout, cos, sin, seq_dim), _zeros_like(cos), _zeros_like(sin), _scalar_grad(seq_dim)

    rope_fwd = custom("RopeFwd", lambda x, c, s, d: x, lambda x, c, s, d: x, rope_bprop)

    # --- residual add (bf16 stream): (a, b) -> a + b ; each input's gradient is dout
    def add_bprop(a, b, out, dout):
        return dout, dout

    add = custom("ResidualAdd", lambda a, b: a, lambda a, b: a, add_bprop)

    # --- fork: x -> (x, x) as two tensors ; bwd: the two gradients summed by ResidualAdd
    def fork_bprop(x, out, dout):
        return (add(dout[0], dout[1]),)

    fork = custom("Fork", lambda x: (x, x), lambda x: (x, x), fork_bprop)

    # --- embedding: (weight [V, h], ids) -> weight[ids] ; bwd (weight, ids, dy) -> dweight
    emb_bwd = custom("EmbeddingBwd", lambda w, ids, dy: w, lambda w, ids, dy: w)

    def emb_bprop(w, ids, out, dout):
        return emb_bwd(w, ids, dout), _zeros_like(ids)

    emb = custom("EmbeddingFwd", lambda w, ids: list(ids) + [w[-1]], lambda w, ids: w, emb_bprop)

    # --- AdamW in place (optim_kernels.cpp): (p, m, v, g, hyper [5], threads) -> done [1]
    adamw = custom("AdamWUpdate", lambda p, m, v, g, h, t: [1], lambda p, m, v, g, h, t: ms.float32)

    # --- bf16 <-> fp32: x -> y ; the gradient converts back
    # (one kernel name per direction: stream_kernels.cpp says why)
    to_bf16 = custom("CastToBf16", _same, lambda x: ms.bfloat16)
    to_f32 = custom("CastToF32", _same, lambda x: ms.float32)
    # (named functions, not lambdas: mindspore.jit parses a bprop's source)
    def to_bf16_bprop(x, out, dout):
        return (to_f32(dout),)

    def to_f32_bprop(x, out, dout):
        return (to_bf16(dout),)

    to_bf16_grad = custom("CastToBf16", _same, lambda x: ms.bfloat16, to_bf16_bprop)
    to_f32_grad = custom("CastToF32", _same, lambda x: ms.float32, to_f32_bprop)

    return {
        "fork": fork,
        "to_bf16": to_bf16_grad,
        "to_f32": to_f32_grad,
        "residual_add": add,
        "embedding": emb,
        "rms_norm": rms_fwd,
        "swiglu": swiglu_fwd,
        "swiglu_bwd": swiglu_bwd,
        "cross_entropy": ce_fwd,
        "adamw_update": adamw,
        "cross_entropy_bwd": ce_bwd,
        "causal_softmax": cs_fwd,
        "rope": rope_fwd,
    }


def _ensure_prims():
    if not available():
        return False
    if not _PRIMS:
        _PRIMS.update(_make_prims())
    return True


# Both helpers are `constexpr`: in PyNative they are plain calls; under `mindspore.jit` they run once at
# compile time (their bodies use try/with/closures that the graph parser cannot handle) and the
# resulting bool / Primitive is a constant of the graph.
@constexpr
def _aot_enabled():
    return _ensure_prims()


@constexpr
def _prim(name):
    return _PRIMS[name]


def _f32(t):
    return t if t.dtype == ms.float32 else t.astype(ms.float32)


@constexpr
def _native(*dtypes):
    """True when the kernel reads and writes these tensors as they are: all fp32, or all bf16
    (widened on load, fp32 arithmetic, rounded on store: the numbers of an fp32 kernel between
    casts, without the cast passes over memory and their dispatch)."""
    return all(d == ms.float32 for d in dtypes) or all(d == ms.bfloat16 for d in dtypes)


def rms_norm(x, weight, eps=1e-6):
    """RMSNorm over the last axis: ``x * rsqrt(mean(x^2, -1) + eps) * weight``. Grads for x and weight."""
    if not _aot_enabled():
        return composed.rms_norm(x, weight, eps)
    if _native(x.dtype, weight.dtype):
        return _prim("rms_norm")(x, weight, float(eps))
    dt = x.dtype
    y = _prim("rms_norm")(_f32(x), _f32(weight), float(eps))
    return y if dt == ms.float32 else y.astype(dt)


_SPLITS: dict = {}


def split_last(x, sections):
    """``x`` split along its last axis into contiguous pieces of the given sizes (fp32 or bf16);
    the gradient is one concatenation of the pieces' gradients. One primitive per sections
    tuple, each keyed by tiny tensors of the sizes (MindSpore reuses an AOT kernel for equal
    input shapes). Composed ``F.split`` when the kernels are unavailable."""
    sections = tuple(int(s) for s in sections)
    if not _aot_enabled() or not _native(x.dtype) or sum(sections) != x.shape[-1]:
        from ms_llm.compat import F
        return F.split(x, list(sections), -1)
    if sections not in _SPLITS:
        from mindspore import mint

        def bprop(*args):
            return (mint.cat(args[-1], -1),) + tuple(_zeros_like(a) for a in args[1:-2])

        keys = tuple(ms.Tensor(np.zeros(s, np.int8)) for s in sections)
        op = ops.Custom(f"{library_path()}:SplitLast", func_type="aot", bprop=bprop,
                        out_shape=lambda xs, *ks: [list(xs[:-1]) + [k[0]] for k in ks],
                        out_dtype=lambda xt, *ks: [xt] * len(ks))
        _SPLITS[sections] = (op, keys)
    op, keys = _SPLITS[sections]
    return tuple(op(x, *keys))


_HEADS: dict = {}


@constexpr
def _split_heads_prim(pieces):
    """SplitHeads for ``pieces`` (heads per group of each piece): (x [B, S, G, W], keys) ->
    pieces. The keys (:func:`_split_keys`) only make each layout's input shapes distinct:
    MindSpore reuses an AOT kernel, output count included, for equal input shapes."""
    key = ("split", pieces)
    if key not in _HEADS:
        def out_shape(xs, *ks):
            return [[xs[0], xs[2] * k[0], xs[1], k[1]] for k in ks]
        _HEADS[key] = ops.Custom(f"{library_path()}:SplitHeads", func_type="aot",
                                 bprop=_SPLIT_BPROPS[len(pieces)], out_shape=out_shape,
                                 out_dtype=lambda xt, *ks: [xt] * len(ks))
    return _HEADS[key]


@constexpr
def _split_keys(pieces, d):
    key = ("split_keys", pieces, d)
    if key not in _HEADS:
        _HEADS[key] = tuple(ms.Tensor(np.zeros((p, d), np.int8)) for p in pieces)
    return _HEADS[key]


@constexpr
def _join_heads_prim(count):
    """JoinHeads of ``count`` pieces: (pieces, key [G]) -> [B, S, G, W]."""
    key = ("join", count)
    if key not in _HEADS:
        def out_shape(*shapes):
            g = shapes[count][0]
            return [shapes[0][0], shapes[0][2], g, sum(sh[1] // g * sh[3] for sh in shapes[:count])]
        _HEADS[key] = ops.Custom(f"{library_path()}:JoinHeads", func_type="aot",
                                 bprop=_JOIN_BPROPS[count], out_shape=out_shape,
                                 out_dtype=lambda *dts: dts[0])
    return _HEADS[key]


@constexpr
def _group_key(groups):
    key = ("group_key", groups)
    if key not in _HEADS:
        _HEADS[key] = ms.Tensor(np.zeros((groups,), np.int8))
    return _HEADS[key]


@constexpr
def _pieces_of(shapes, groups):
    return tuple(sh[1] // groups for sh in shapes)


# Module-level bprops, one per piece count with named parameters, reaching the other primitive
# through constexpr helpers: so they also compile under ``mindspore.jit`` (a graph-mode bprop
# needs named ``out`` / ``dout`` parameters and no closure over local names).
def _split_grad(x, keys, dout):
    dx = _join_heads_prim(len(dout))(*dout, _group_key(x.shape[2]))
    return (dx,) + tuple(_zeros_like(k) for k in keys)


def _join_grad(parts, gkey, dout):
    pieces = _pieces_of(tuple(p.shape for p in parts), gkey.shape[0])
    keys = _split_keys(pieces, dout.shape[3] // sum(pieces))
    return tuple(_split_heads_prim(pieces)(dout, *keys)) + (_zeros_like(gkey),)


def _split_bprop_1(x, k0, out, dout):
    return _split_grad(x, (k0,), dout)


def _split_bprop_2(x, k0, k1, out, dout):
    return _split_grad(x, (k0, k1), dout)


def _split_bprop_3(x, k0, k1, k2, out, dout):
    return _split_grad(x, (k0, k1, k2), dout)


def _split_bprop_4(x, k0, k1, k2, k3, out, dout):
    return _split_grad(x, (k0, k1, k2, k3), dout)


def _join_bprop_1(p0, g, out, dout):
    return _join_grad((p0,), g, dout)


def _join_bprop_2(p0, p1, g, out, dout):
    return _join_grad((p0, p1), g, dout)


def _join_bprop_3(p0, p1, p2, g, out, dout):
    return _join_grad((p0, p1, p2), g, dout)


def _join_bprop_4(p0, p1, p2, p3, g, out, dout):
    return _join_grad((p0, p1, p2, p3), g, dout)


_SPLIT_BPROPS = {1: _split_bprop_1, 2: _split_bprop_2, 3: _split_bprop_3, 4: _split_bprop_4}
_JOIN_BPROPS = {1: _join_bprop_1, 2: _join_bprop_2, 3: _join_bprop_3, 4: _join_bprop_4}
MAX_HEAD_PIECES = 4


def split_heads(x, pieces):
    """``x`` [B, S, G, W] (per group the pieces' heads side by side, ``W = D * sum(pieces)``) as
    one contiguous [B, G * p, S, D] tensor per piece (p = ``pieces[i]`` heads per group; head
    ``g * p + h``), fp32 / bf16 / fp16; at most ``MAX_HEAD_PIECES`` pieces. The gradient is
    :func:`join_heads`."""
    pieces = tuple(int(p) for p in pieces)
    if not 1 <= len(pieces) <= MAX_HEAD_PIECES:
        raise ValueError(f"split_heads: {len(pieces)} pieces; the kernel takes 1-{MAX_HEAD_PIECES}")
    keys = _split_keys(pieces, int(x.shape[-1]) // sum(pieces))
    return tuple(_split_heads_prim(pieces)(x, *keys))


def join_heads(parts, groups: int):
    """Inverse of :func:`split_heads`: pieces [B, G * p_i, S, D] -> [B, S, G, D * sum(p_i)]."""
    parts = tuple(parts)
    if not 1 <= len(parts) <= MAX_HEAD_PIECES:
        raise ValueError(f"join_heads: {len(parts)} pieces; the kernel takes 1-{MAX_HEAD_PIECES}")
    return _join_heads_prim(len(parts))(*parts, _group_key(int(groups)))


def cast_float(x, dtype):
    """``x.astype(dtype)`` between fp32 and bf16 (either way; differentiable) in one C pass;
    ``astype`` for other dtypes, equal dtypes or without the kernels."""
    if x.dtype == dtype or not _aot_enabled() or not _native(x.dtype) or \
            dtype not in (ms.float32, ms.bfloat16):
        return x if x.dtype == dtype else x.astype(dtype)
    return _prim("to_f32" if dtype == ms.float32 else "to_bf16")(x)


def fork(x):
    """``(x, x)`` as two fp32 or bf16 tensors whose gradients one C op sums (the residual
    stream's two uses); ``(x, x)`` itself otherwise."""
    if not _aot_enabled() or not _native(x.dtype):
        return x, x
    return tuple(_prim("fork")(x))


def residual_add(a, b):
    """``a + b`` for two fp32 or two bf16 tensors of one shape, rounded once (MindSpore 2.10's CPU
    bf16 Add runs ~50x slower than this). Grads: dout for each. Composed ``a + b`` otherwise."""
    if not _aot_enabled() or not _native(a.dtype, b.dtype) or a.shape != b.shape:
        return a + b
    return _prim("residual_add")(a, b)


def embedding(ids, weight):
    """``weight[ids]`` for an fp32 or bf16 table and int32/int64 ids; the gradient sums each id's
    rows in fp32 and rounds once (no cast of the whole table, no dense fp32 gradient). An id
    outside [0, V) raises."""
    if not _aot_enabled() or not _native(weight.dtype) or ids.dtype not in (ms.int32, ms.int64):
        return composed.embedding(ids, weight)
    return _prim("embedding")(weight, ids)


def swiglu(x):
    """``silu(x[..., :F]) * x[..., F:]`` for x [..., 2F] (Megatron fused fc1 layout). Grad for x."""
    if not _aot_enabled():
        return composed.swiglu(x)
    if _native(x.dtype):
        return _prim("swiglu")(x)
    dt = x.dtype
    y = _prim("swiglu")(_f32(x))
    return y if dt == ms.float32 else y.astype(dt)


def swiglu_grad(x, dy):
    """Gradient of ``swiglu`` with respect to x for output gradient dy (the kernel autograd uses),
    for pipelines that run their own backward."""
    if not _aot_enabled():
        return None
    return _prim("swiglu_bwd")(_f32(x), _f32(dy))


def cross_entropy(logits, labels, ignore_index=-100):
    """Per-token cross entropy ``logsumexp(logits) - logits[label]`` of shape labels.shape (logits
    [..., V], labels [...] int32/int64), 0 where ``labels == ignore_index``. Grad for logits only.
    A label outside [0, V) that is not ignore_index raises. bf16 logits are read as they are
    (fp32 arithmetic; their gradient is bf16, rounded once): no cast pass over [N, V]."""
    if not _aot_enabled():
        return composed.cross_entropy(logits, labels, ignore_index)
    lf = logits if logits.dtype == ms.bfloat16 else _f32(logits)
    lab = labels       # logits stay [..., V]: the kernel reads every leading index as a row
    if len(labels.shape) != 1:
        lab = lab.reshape(-1)
    if lab.dtype != ms.int32 and lab.dtype != ms.int64:
        lab = lab.astype(ms.int32)
    loss = _prim("cross_entropy")(lf, lab, int(ignore_index))[0]
    if len(labels.shape) != 1:
        loss = loss.reshape(labels.shape)
    return loss


def cross_entropy_lse(logits, labels, ignore_index=-100):
    """``(loss [N], logsumexp [N])`` of fp32 logits [N, V] and labels [N] (0 and 0 where ignored),
    for ops that run their own backward (:func:`cross_entropy_grad`); no autograd of its own
    needed. Composed fallback when the AOT kernels are unavailable."""
    if not _aot_enabled():
        return composed.cross_entropy_lse(logits, labels, ignore_index)
    return _prim("cross_entropy")(logits, labels, int(ignore_index))


def cross_entropy_grad(logits, labels, lse, dloss, ignore_index=-100):
    """``dlogits = (softmax(logits) - onehot(label)) * dloss[:, None]`` (rows of ignored labels 0)
    from the forward's ``lse``: the cross entropy's backward kernel, fp32 [N, V]."""
    if not _aot_enabled():
        return composed.cross_entropy_grad(logits, labels, lse, dloss, ignore_index)
    return _prim("cross_entropy_bwd")(logits, labels, lse, dloss, int(ignore_index))


def rope(x, cos, sin, seq_dim=-2):
    """Rotary embedding, rotate-half form: ``x * cos + rotate_half(x) * sin``.

    x: [..., S, ..., D] with the sequence axis at ``seq_dim`` (default -2, i.e. [..., S, D] such as
    [B, H, S, D]; use seq_dim=1 for [B, S, H, D], 0 for [S, B, H, D]); cos, sin: [S, D] (any shape with
    S*D elements). Grad for x only.
    """
    if not _aot_enabled():
        return composed.rope(x, cos, sin, seq_dim)
    if _native(x.dtype):   # x fp32 or bf16 as it is; the tables always fp32
        return _prim("rope")(x, _f32(cos), _f32(sin), int(seq_dim))
    dt = x.dtype
    y = _prim("rope")(_f32(x), _f32(cos), _f32(sin), int(seq_dim))
    return y if dt == ms.float32 else y.astype(dt)


def causal_softmax(scores, scale=1.0):
    """``softmax(scale * scores)`` over the last axis with a causal mask (key k allowed for query q iff
    k <= q + Sk - Sq); masked positions are exactly 0. scores: [..., Sq, Sk]. Grad for scores."""
    if not _aot_enabled():
        return composed.causal_softmax(scores, scale)
    dt = scores.dtype
    y = _prim("causal_softmax")(_f32(scores), float(scale))
    return y if dt == ms.float32 else y.astype(dt)


def adamw_update(param, exp_avg, exp_avg_sq, grad, hyper, threads: int) -> bool:
    """MindSpore's ``AdamWeightDecay`` update of fp32 ``param`` and its moments, in place, on
    ``threads`` threads (``optim_kernels.cpp``); ``hyper``: fp32 [lr, beta1, beta2, eps,
    decay]. Every tensor must own its whole storage (Parameters, not views: the kernel writes
    through their buffers). False (nothing done) when the kernels are unavailable."""
    if not _aot_enabled():
        return False
    _prim("adamw_update")(param, exp_avg, exp_avg_sq, grad, hyper, int(threads))
    return True
