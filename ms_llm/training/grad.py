"""Gradient accumulation and global-norm clipping (torch.nn.utils.clip_grad_norm_ semantics)."""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import numpy as np
from mindspore import Tensor, mint

from ms_llm.compat import F, float32
from ms_llm.ops import cast
from ms_llm.parallel.placement import counted_in_norm, norm_dims, placement_of


def accumulate(acc: Optional[List[Tensor]], grads: Sequence[Tensor],
               dtype=float32) -> List[Tensor]:
    """Sum micro-batch gradients in ``dtype``: fp32 (bf16 gradients of a ``training.bf16`` run
    upcast, by one C pass each on CPU), or bf16 with ``parallel.grad_reduce_in_fp32: false``
    (Megatron's bf16 grad buffer)."""
    grads = [g if g.dtype == dtype else cast(g, dtype) for g in grads]
    if acc is None:
        return list(grads)
    return [a + g for a, g in zip(acc, grads)]


def sum_of_squares(grads: Sequence[Tensor]) -> Tensor:
    """Sum of squares of all gradients (also used inside the jitted forward/backward graph)."""
    total = mint.sum(grads[0] * grads[0])
    for g in grads[1:]:
        total = total + mint.sum(g * g)
    return total


# Elements squared at a time by ``host_sum_of_squares``: a whole-tensor ``np.square`` of the
# 151936 x 1024 embedding gradient of Qwen3-0.6B is a 0.58 GiB temporary, the largest of its
# step's gradient-norm phase (benchmarks/memory.py); 4 Mi elements (16 MiB) keep it negligible.
SQUARE_CHUNK = 1 << 22


def host_sum_of_squares(grads: Sequence[Tensor]) -> float:
    """Sum of squares on the host: NumPy's pairwise float32 summation over zero-copy views is
    ~8x faster than one MindSpore reduction per tensor in PyNative (34 vs 250 ms for 55 M
    gradients here) and as accurate (2e-8 relative against float64). Squared in chunks of
    ``SQUARE_CHUNK`` elements into one reused buffer, so no gradient-sized temporary exists."""
    total = 0.0
    buf = None
    for g in grads:
        a = g.asnumpy().reshape(-1)
        if a.dtype != np.float32:
            a = a.astype(np.float32)
        if a.size <= SQUARE_CHUNK:
            total += float(np.sum(np.square(a)))
            continue
        if buf is None:
            buf = np.empty(SQUARE_CHUNK, np.float32)
        for s in range(0, a.size, SQUARE_CHUNK):
            part = a[s:s + SQUARE_CHUNK]
            out = buf[:part.size]
            np.square(part, out=out)
            total += float(np.sum(out))
    return total


_NORM_DIMS = ("tp", "cp", "dp", "ep", "edp", "pp", "etp")


def global_norm(grads: Sequence[Tensor], params: Sequence = None, groups=None,
                mesh=None) -> float:
    """L2 norm of the full (unsharded) gradient. Each gradient's squares are summed over the
    mesh dims its parameter is sharded over (its ``Placement``: tp, FSDP's dp, ep, pp); replicated
    parameters count once. ``groups(dim)`` returns the process group of a mesh dim; ``mesh``
    (``placement.Mesh``) leaves out second copies of tensors held on two stages.

    Ranks may hold different kinds of parameters (pipeline stages, MoE layers on some stages), so
    the partial sums travel in one fixed-size vector, one slot per set of dims, and every rank
    issues the same all-reduces (one per dim of size > 1) whatever it holds."""
    if not grads:
        return 0.0
    if params is None:
        return math.sqrt(host_sum_of_squares(grads))
    from ms_llm.parallel import comm
    slots = np.zeros(2 ** len(_NORM_DIMS), np.float64)
    by_slot = {}
    for g, p in zip(grads, params):
        pl = placement_of(p)
        if mesh is None or counted_in_norm(pl, mesh):
            slot = sum(1 << _NORM_DIMS.index(d) for d in norm_dims(pl))
            by_slot.setdefault(slot, []).append(g)
    for slot, gs in by_slot.items():
        slots[slot] = host_sum_of_squares(gs)
    for bit, dim in enumerate(_NORM_DIMS):
        group = groups(dim)
        if group.size == 1:
            continue
        mask = (np.arange(slots.size) >> bit) & 1 == 1
        part = Tensor(np.where(mask, slots, 0.0).astype(np.float32))
        comm.all_reduce(part, group=group)
        slots = np.where(mask, part.asnumpy().astype(np.float64), slots)
    return math.sqrt(float(slots.sum()))


def reduce_partial_grads(params: Sequence, grads: List[Tensor], groups) -> List[Tensor]:
    """Sum the gradients that each rank holds only in part (``Placement.partial``: norm weights
    under sequence parallel, QK-norm weights under tensor parallel) over those mesh dims."""
    from ms_llm.parallel import comm
    out = list(grads)
    for i, p in enumerate(params):
        for dim in placement_of(p).partial:
            group = groups(dim)
            if group.size > 1:
                g = F.clone(out[i])
                comm.all_reduce(g, group=group)
                out[i] = g
    return out


def clip_(grads: List[Tensor], max_norm: float, norm: float) -> List[Tensor]:
    """Scale by max_norm / (norm + 1e-6) when the norm exceeds max_norm (torch's rule). The
    list is updated in place, one tensor at a time, so each old gradient is freed as its scaled
    one is made: the peak is the gradients plus one gradient, not two sets of them (2.2 GiB at
    Qwen3-0.6B; the caller's list must be the only holder of the old tensors). Not in place on
    the tensors: on CPU a reduced gradient's host view need not be the memory MindSpore's next
    op reads (writing it diverged the dp=2 curve), and 2.10's ``mul_`` is not a reliable in-place
    update there either."""
    if max_norm <= 0 or norm <= max_norm:
        return grads
    coef = max_norm / (norm + 1e-6)
    if not isinstance(grads, list):      # a tuple: nothing to update in place
        return [g * coef for g in grads]
    for i, g in enumerate(grads):
        grads[i] = g * coef
    return grads
