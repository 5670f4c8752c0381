"""Dropless MoE kernels: token permutation by expert and the grouped matmul over experts.

The routed rows (token ``t``'s ``j``-th choice is *slot* ``t*k + j``) are sorted by expert, so each
expert's rows are one contiguous block and the experts' FFNs become one grouped matmul over the
blocks; the combine gathers the rows back to slot order and sums each token's ``k`` rows weighted
by its routing probabilities. No token is dropped and no capacity is assumed.

The block sizes (``tokens_per_expert``) are data dependent, so they are brought to the host once
per layer (``E`` integers): the grouped matmul's CPU forms and Ascend's ``gmm`` take them as a list.
This is also why the MoE layer runs in PyNative only (``mindspore.jit`` cannot compile shapes that
depend on the routing).

Grouped matmul forms (``impl``), measured by ``benchmarks/moe_layer.py``:

* ``"loop"``: ``split`` the sorted rows per expert, one matmul per non-empty expert, ``cat``.
  No padding; experts that received no token issue no matmul (their weights get zero gradient).
* ``"padded_bmm"``: gather the rows into ``[E, max_tokens, K]`` (zero rows pad the short experts),
  one batched matmul, gather the real rows back. One kernel, but ``E * max_tokens`` rows of work.
* ``"native"``: MindSpore's grouped-matmul kernel (``gmm``), Ascend only. **Untested here** (no
  Ascend device in this project's CI); selected only on Ascend.

Fused CPU path (fp32 with the OpenBLAS kernel library, ``cpu_kernels/model/blas_moe.cpp``): the sort,
the row permutation, the whole SwiGLU expert FFN (both GEMMs of every expert) and the weighted
combine are one op each, forward and backward, and the block sizes stay an int32 device tensor
(``sort_by_expert_device``; no host copy in the step). With 64 experts of FFN 256 the composed
form issued several hundred small ops per layer; ``benchmarks/moe_layer.py --breakdown`` measures
both. ``fused_available`` says when it applies; the composed functions below remain the reference
and the path for bf16, Ascend and quantized experts.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List, Sequence, Tuple, Union

import numpy as np
from mindspore import Tensor, mint, ops

from ms_llm.compat import F, bfloat16, float32, int32, is_ascend, is_cpu
from ms_llm.compat.private_api import grouped_matmul_kernel
from .linear import bmm, linear

Weights = Union[Tensor, Sequence[Tensor]]
IMPLS = ("loop", "padded_bmm", "native")
# benchmarks/moe_layer.py on the shared 2-core CPU: "loop" costs about what the per-expert-module
# baseline costs in every case; "padded_bmm" wins when routing is balanced over many experts
# (fewer kernel launches) but loses 2-5x under skewed routing (padding to the largest block),
# which is the normal state early in training. "loop" has no such cliff.
CPU_DEFAULT_IMPL = "loop"


Sizes = Union[Sequence[int], Tensor]
_FUSED = {"enabled": True}


@contextlib.contextmanager
def composed_only() -> Iterator[None]:
    """Run the composed (pre-fusion) MoE ops inside the block: the reference the fused path is
    tested against, and the baseline row of the benchmarks."""
    before = _FUSED["enabled"]
    _FUSED["enabled"] = False
    try:
        yield
    finally:
        _FUSED["enabled"] = before


def fused_available(*tensors: Tensor) -> bool:
    """True when the fused CPU MoE kernels apply: CPU, the BLAS kernel library loaded, every
    given tensor fp32, and not inside ``composed_only()``."""
    if not _FUSED["enabled"] or not is_cpu() or any(t.dtype != float32 for t in tensors):
        return False
    from .cpu_kernels.model.blas_moe import moe_kernels_available
    return moe_kernels_available()


def host_sizes(tokens_per_expert: Sizes) -> List[int]:
    """Block sizes as a host list (one device-to-host copy when they are a tensor)."""
    if isinstance(tokens_per_expert, Tensor):
        return [int(v) for v in tokens_per_expert.asnumpy().reshape(-1)]
    return [int(v) for v in tokens_per_expert]


def sort_by_expert_device(top_indices: Tensor, num_experts: int
                          ) -> Tuple[Tensor, Tensor, Tensor]:
    """``sort_by_expert`` in one fused op, with ``tokens_per_expert`` an int32 ``[E]`` tensor
    (no host copy). Needs ``fused_available()``."""
    from .cpu_kernels.model.blas_moe import sort_by_expert as fused_sort
    return fused_sort(top_indices, num_experts)


def permute_rows(tokens: Tensor, sorted_slots: Tensor, restore: Tensor) -> Tensor:
    """``permute`` as one fused op (its backward sums each token's k rows without a scatter).
    Needs ``fused_available(tokens)``."""
    from .cpu_kernels.model.blas_moe import permute as fused_permute
    return fused_permute(tokens, sorted_slots, restore)


def expert_ffn(x: Tensor, w1: Weights, w2: Weights, tokens_per_expert: Sizes,
               transpose_b: bool) -> Tensor:
    """``grouped_matmul(swiglu(grouped_matmul(x, w1)), w2)`` as one fused op (and one for its
    backward). Weights as in ``grouped_matmul``. Needs ``fused_available(x, ...)``."""
    from .cpu_kernels.model.blas_moe import expert_ffn as fused_ffn
    sizes = tokens_per_expert if isinstance(tokens_per_expert, Tensor) else \
        Tensor(np.asarray([int(v) for v in tokens_per_expert], np.int32))
    if sizes.dtype != int32:
        sizes = sizes.astype(int32)
    ws1 = [w1] if isinstance(w1, Tensor) else list(w1)
    ws2 = [w2] if isinstance(w2, Tensor) else list(w2)
    return fused_ffn(x, sizes, ws1, ws2, transpose_b)


def sort_by_expert(top_indices: Tensor, num_experts: int) -> Tuple[Tensor, Tensor, List[int]]:
    """Order the routed slots by expert.

    ``top_indices``: ``[T, k]`` expert ids. Returns ``(sorted_slots, restore, tokens_per_expert)``:
    ``sorted_slots[i]`` is the slot (``t*k + j``) that lands on row ``i`` of the permuted tensor
    (expert-major, slot order inside an expert, so the result is deterministic);
    ``restore[s]`` is the permuted row of slot ``s`` (the inverse permutation);
    ``tokens_per_expert`` is a host list of ``E`` block sizes.
    """
    if fused_available():
        sorted_slots, restore, counts = sort_by_expert_device(top_indices, num_experts)
        return sorted_slots, restore, host_sizes(counts)
    n = top_indices.shape[0] * top_indices.shape[1]
    if num_experts * n >= 2 ** 31:
        raise ValueError(f"sort_by_expert: {num_experts} experts x {n} routed slots overflow the "
                         f"int32 sort key")
    flat = top_indices.reshape(-1).astype(int32)
    # Unique keys (expert-major, then slot) make any sort stable.
    keys = flat * n + ops.arange(0, n, 1, dtype=int32)
    _, sorted_slots = ops.sort(keys)
    sorted_slots = sorted_slots.astype(int32)
    restore = ops.argsort(sorted_slots).astype(int32)
    counts = ops.bincount(flat, minlength=num_experts) if is_cpu() else \
        mint.bincount(flat, minlength=num_experts)
    tokens_per_expert = [int(c) for c in counts.asnumpy()[:num_experts]]
    return sorted_slots, restore, tokens_per_expert


def permute(tokens: Tensor, sorted_slots: Tensor, topk: int) -> Tensor:
    """``[T, H]`` tokens -> ``[T*k, H]`` rows in expert order (a token routed to k experts appears
    k times; the gather's gradient sums the k copies back)."""
    return F.embedding(sorted_slots // topk, tokens)  # a row gather with the bf16-on-CPU fallback


def unpermute(expert_out: Tensor, restore: Tensor, probs: Tensor) -> Tensor:
    """Inverse of ``permute`` plus the weighted combine: ``[T*k, H]`` expert rows ->
    ``sum_j probs[t, j] * row(t*k + j)``, ``[T, H]``. ``probs`` is ``[T, k]``."""
    t, k = probs.shape
    if fused_available(expert_out, probs) and expert_out.shape[0] == t * k:
        from .cpu_kernels.model.blas_moe import combine
        return combine(expert_out, restore.astype(int32), probs)
    rows = F.embedding(restore, expert_out).reshape(t, k, expert_out.shape[-1])
    if rows.dtype == float32:
        return F.sum(rows * probs.astype(rows.dtype).reshape(t, k, 1), 1)
    # bf16 rows: combine in fp32 (probs' gradient is a sum over H; MindSpore's CPU backend has
    # no bf16 reduction kernel, and fp32 keeps the k-way sum exact before one rounding)
    out = F.sum(rows.astype(float32) * probs.astype(float32).reshape(t, k, 1), 1)
    return out.astype(rows.dtype)


def _stacked(weight: Weights) -> Tensor:
    if isinstance(weight, Tensor):
        return weight
    # cat of [1, ...] views: ops.stack's type inference rejects a mix of Parameters that did and
    # did not take part in an earlier backward ("Ref[Tensor] vs Tensor", MindSpore 2.10).
    return F.cat([w.reshape(1, *w.shape) for w in weight], 0)


def grouped_matmul(x: Tensor, weight: Weights, tokens_per_expert: Sizes, *,
                   transpose_b: bool = False, impl: str = "auto") -> Tensor:
    """Per expert block ``e`` of the sorted rows ``x`` (``[N, K]``), ``x_e @ W_e``.

    ``weight`` is a ``[E, K, M]`` tensor (``[E, M, K]`` with ``transpose_b``, i.e. torch/Megatron
    ``Linear`` weights) or a sequence of ``E`` 2-D weights in the same per-expert layout.
    Returns ``[N, M]`` in the same row order.
    """
    sizes = host_sizes(tokens_per_expert)
    n_exp = weight.shape[0] if isinstance(weight, Tensor) else len(weight)
    if len(sizes) != n_exp:
        raise ValueError(f"grouped_matmul: {len(sizes)} group sizes for {n_exp} experts")
    if sum(sizes) != x.shape[0]:
        raise ValueError(f"grouped_matmul: group sizes add up to {sum(sizes)}, x has "
                         f"{x.shape[0]} rows")
    if impl == "auto":
        impl = "native" if is_ascend() else CPU_DEFAULT_IMPL
    if impl != "native" and x.dtype == bfloat16:
        # bf16 on CPU: the per-expert slices' backward has no bf16 kernel in MindSpore 2.10
        # (UnsortedSegmentSum), so slice fp32 copies; the products are the same (bf16 values,
        # fp32 accumulation, one rounding of the result to bf16).
        w32 = weight.astype(float32) if isinstance(weight, Tensor) else \
            [w.astype(float32) for w in weight]
        return grouped_matmul(x.astype(float32), w32, sizes, transpose_b=transpose_b,
                              impl=impl).astype(bfloat16)
    if impl == "loop":
        return _gmm_loop(x, weight, sizes, transpose_b)
    if impl == "padded_bmm":
        return _gmm_padded(x, weight, sizes, transpose_b)
    if impl == "native":
        return _gmm_native(x, weight, sizes, transpose_b)
    raise ValueError(f"grouped_matmul: impl {impl!r} is not one of {('auto',) + IMPLS}")


def _gmm_loop(x: Tensor, weight: Weights, sizes: List[int], transpose_b: bool) -> Tensor:
    pieces = F.split(x, sizes, 0)
    outs = []
    for e, (xe, size) in enumerate(zip(pieces, sizes)):
        if size == 0:
            continue
        w = weight[e]
        if transpose_b:
            outs.append(linear(xe, w))
        else:  # [K, M] weight: the batched kernel with a batch of one keeps the fast BLAS path
            outs.append(bmm(xe.reshape(1, *xe.shape), w.reshape(1, *w.shape))[0])
    return outs[0] if len(outs) == 1 else F.cat(outs, 0)


def padded_indices(sizes: List[int]) -> Tuple[np.ndarray, np.ndarray, int]:
    """Host-side index maps of the padded form: ``pad[e*cap + r]`` is the sorted row feeding slot
    ``r`` of expert ``e`` (``N`` = the appended zero row for padding); ``unpad[i]`` is the padded
    slot of sorted row ``i``."""
    n, cap = int(sum(sizes)), max(1, max(sizes))
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    pad = np.full((len(sizes), cap), n, dtype=np.int32)
    unpad = np.empty(n, dtype=np.int32)
    for e, (off, size) in enumerate(zip(offsets, sizes)):  # E iterations, vectorised inside
        pad[e, :size] = np.arange(off, off + size, dtype=np.int32)
        unpad[off:off + size] = e * cap + np.arange(size, dtype=np.int32)
    return pad.reshape(-1), unpad, cap


def _gmm_padded(x: Tensor, weight: Weights, sizes: List[int], transpose_b: bool) -> Tensor:
    pad, unpad, cap = padded_indices(sizes)
    w = _stacked(weight)
    xz = F.cat([x, F.zeros(1, x.shape[1], dtype=x.dtype)], 0)
    xp = F.embedding(Tensor(pad), xz).reshape(len(sizes), cap, x.shape[1])
    y = bmm(xp, w, transpose_b=transpose_b)
    return F.embedding(Tensor(unpad), y.reshape(len(sizes) * cap, y.shape[-1]))


GMM_MAX_GROUPS = 1024   # gmm's documented limit for a Tensor group_list


def _gmm_native(x: Tensor, weight: Weights, sizes: List[int], transpose_b: bool) -> Tensor:
    """UNTESTED (needs an Ascend device): MindSpore's grouped matmul ``gmm`` with ``group_type=0``
    (rows grouped), ``group_list`` the cumulative block ends, weights ``[E, K, M]``."""
    if not is_ascend():
        raise RuntimeError("grouped_matmul impl 'native' needs an Ascend device (the CPU backend "
                           "has no GroupedMatmul kernel); use 'loop' or 'padded_bmm'")
    gmm = grouped_matmul_kernel()   # Ascend-only kernel behind it
    w = _stacked(weight)
    if transpose_b:
        w = w.swapaxes(1, 2)
    # A Tensor group list: MindSpore documents a Python list as at most 128 groups, a Tensor as
    # at most 1024 (160-, 256- and 512-expert configs at little expert parallelism need it).
    if len(sizes) > GMM_MAX_GROUPS:
        raise ValueError(f"grouped_matmul impl 'native': {len(sizes)} local experts, MindSpore's "
                         f"gmm takes at most {GMM_MAX_GROUPS}; raise expert parallelism")
    ends = Tensor(np.cumsum(sizes).astype(np.int64))
    return gmm([x], [w], group_list=ends, group_type=0)[0]


# ----------------------------------------------------------------------------- explicit expert FFN
# Forward and backward of the SwiGLU expert FFN written out GEMM by GEMM, for pipelines that
# schedule the backward themselves (MegaMoE: each expert group's backward GEMMs run while the
# next group's gradient all-to-all is in flight). Plain MoE layers use autograd instead.

def matmul(a: Tensor, b: Tensor, transpose_a: bool = False, transpose_b: bool = False) -> Tensor:
    """2-D ``op(a) @ op(b)`` on the fast path (OpenBLAS on CPU)."""
    if is_cpu():
        from .cpu_kernels.gemm import blas
        return blas.bmm(a.reshape(1, *a.shape), b.reshape(1, *b.shape),
                        transpose_a, transpose_b)[0]
    aa = a.swapaxes(0, 1) if transpose_a else a
    bb = b.swapaxes(0, 1) if transpose_b else b
    return mint.matmul(aa, bb)


def swiglu_backward(h: Tensor, d_act: Tensor) -> Tensor:
    """Gradient of ``silu(gate) * up`` (``h = [gate, up]``) with respect to ``h``: the C++
    kernel autograd uses on CPU, composed ops elsewhere."""
    from ._dispatch import path_for
    if path_for("swiglu") == "aot":
        from .cpu_kernels.model.functional import swiglu_grad
        g = swiglu_grad(h, d_act)
        if g is not None:
            return g.astype(h.dtype)
    gate, up = mint.chunk(h, 2, -1)
    s = mint.sigmoid(gate)
    silu = gate * s
    d_gate = d_act * up * (s * (1 + gate * (1 - s)))
    return mint.cat([d_gate, d_act * silu], -1)


def _blocks(x: Tensor, sizes: Sequence[int]) -> List[Tensor]:
    return list(F.split(x, [int(s) for s in sizes], 0)) if len(sizes) > 1 else [x]


def expert_ffn_forward(x: Tensor, w1: Weights, w2: Weights, sizes: Sequence[int],
                       transpose_b: bool) -> Tuple[Tensor, Tuple[List[Tensor], List[Tensor]]]:
    """``y = swiglu(x_e W1_e) W2_e`` per expert block; returns ``(y, saved)`` with ``saved`` the
    per-block fc1 outputs ``h`` and activations ``a`` kept for backward. Weights as in
    ``grouped_matmul`` (``transpose_b``: Linear layout ``[M, K]``)."""
    from .swiglu import swiglu
    hs, acts, ys = [], [], []
    for e, xe in enumerate(_blocks(x, sizes)):
        if int(sizes[e]) == 0:
            continue
        h = matmul(xe, w1[e], transpose_b=transpose_b)
        a = swiglu(h)
        hs.append(h)
        acts.append(a)
        ys.append(matmul(a, w2[e], transpose_b=transpose_b))
    if not ys:
        out_dim = w2[0].shape[0] if transpose_b else w2[0].shape[1]
        return mint.zeros((0, out_dim), dtype=x.dtype), (hs, acts)
    return (ys[0] if len(ys) == 1 else F.cat(ys, 0)), (hs, acts)


def expert_ffn_backward_data(dy: Tensor, saved, w1: Weights, w2: Weights,
                             sizes: Sequence[int], transpose_b: bool
                             ) -> Tuple[Tensor, List[Tensor]]:
    """Activation gradients of ``expert_ffn_forward``: ``(dx, [dh per block])`` (``dh`` feeds
    the weight gradients). Split from the weight gradients so a pipeline can send ``dx`` first
    and compute ``dW`` while it travels."""
    hs, _ = saved
    live = [e for e, s in enumerate(sizes) if int(s)]
    live_sizes = [int(sizes[e]) for e in live]
    if not live:
        in_dim = w1[0].shape[1] if transpose_b else w1[0].shape[0]
        return mint.zeros((0, in_dim), dtype=dy.dtype), []
    dys = _blocks(dy, live_sizes)
    dxs, dhs = [], []
    for i, e in enumerate(live):
        d_a = matmul(dys[i], w2[e], transpose_b=not transpose_b)
        dh = swiglu_backward(hs[i], d_a)
        dhs.append(dh)
        dxs.append(matmul(dh, w1[e], transpose_b=not transpose_b))
    return (dxs[0] if len(dxs) == 1 else F.cat(dxs, 0)), dhs


def expert_ffn_backward_weight(dy: Tensor, x: Tensor, saved, dhs: List[Tensor], w1: Weights,
                               w2: Weights, sizes: Sequence[int], transpose_b: bool
                               ) -> Tuple[List[Tensor], List[Tensor]]:
    """Weight gradients ``([dW1_e], [dW2_e])`` in the weights' own layout; an expert without
    rows gets zeros."""
    _, acts = saved
    live = [e for e, s in enumerate(sizes) if int(s)]
    live_sizes = [int(sizes[e]) for e in live]
    dw1 = [F.zeros_like(w) for w in per_expert(w1)]
    dw2 = [F.zeros_like(w) for w in per_expert(w2)]
    if not live:
        return dw1, dw2
    dys, xs = _blocks(dy, live_sizes), _blocks(x, live_sizes)
    for i, e in enumerate(live):
        a = acts[i]
        if transpose_b:     # Linear layout: W1 [2F, H], W2 [H, F]
            dw2[e] = matmul(dys[i], a, transpose_a=True)
            dw1[e] = matmul(dhs[i], xs[i], transpose_a=True)
        else:               # W1 [H, 2F], W2 [F, H]
            dw2[e] = matmul(a, dys[i], transpose_a=True)
            dw1[e] = matmul(xs[i], dhs[i], transpose_a=True)
    return dw1, dw2


def per_expert(w: Weights) -> List[Tensor]:
    """Expert weights as a list, from a ``[E, ...]`` tensor or a sequence."""
    return [w[e] for e in range(w.shape[0])] if isinstance(w, Tensor) else list(w)
