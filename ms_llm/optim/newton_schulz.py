"""Newton-Schulz orthogonalisation in fp32 (Muon's ``zeroth power`` of a matrix), with the
coefficient schedules and update scale modes of NVIDIA's ``emerging_optimizers``
(``orthogonalized_optimizers/muon_utils.py`` and ``muon.py``, read, not imported: the package
index does not serve it).

For ``X`` (the smaller dimension first, transposing if needed) normalised by its Frobenius norm,
each step with coefficients ``(a, b, c)`` is ``A = X X^T; X = (a I + b A + c A A) X``. Schedules
that list fewer sets than steps cycle (``simple``, ``quintic``, ``aol``) or repeat their last set
(``polar_express``, ``cans``), as the reference does. By default everything runs in fp32
(``training.muon_fp32_matmul_prec: highest``), so the result is deterministic and matches a NumPy
reference to fp32 rounding; ``medium`` (Megatron-Core's default, where the GEMMs run in bf16)
rounds the GEMM operands to bf16 with fp32 accumulation (``MATMUL_PRECISIONS``).

On CPU with the BLAS kernel library built, the whole iteration of a batch of matrices is one op
(``ms_llm.ops.cpu_kernels.optimizer.muon_ns``: no per-op dispatch, the symmetric products as
SYRK); the composed ``mint`` form below runs elsewhere and for tensor-parallel ``distributed``
shards.
"""
from __future__ import annotations

import functools
import itertools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from mindspore import Tensor, mint

from ms_llm.ops.cpu_kernels.optimizer.muon_ns import bf16_ns_available, newton_schulz_kernel, \
    ns_kernel_available

Coeffs = Tuple[float, float, float]

COEFFICIENTS: Dict[str, List[Coeffs]] = {
    "simple": [(3.4445, -4.7750, 2.0315)],
    "quintic": [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377),
                (3.7418, -5.5913, 2.3037), (2.8769, -3.1427, 1.2046),
                (2.8366, -3.0525, 1.2012)],
    "polar_express": [(8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184),
                      (3.9096, -2.8234, 0.5250), (3.2856, -2.4153, 0.4853),
                      (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)],
    "cans": [(8.4703, -25.1081, 18.6293), (4.1828, -3.1087, 0.5806), (3.9619, -2.9541, 0.5630),
             (3.2866, -2.4647, 0.5074), (2.2737, -1.6447, 0.4162)],
    "aol": [(4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959), (2.7573, -3.2939, 1.4254),
            (2.7215, -3.0494, 1.3169)],
}
REPEAT_LAST = ("polar_express", "cans")
BATCH_ELEMENTS = 1 << 25   # at most 32M fp32 elements (128 MiB) per batched Newton-Schulz input
SCALE_MODES = ("spectral", "shape_scaling", "unit_rms_norm")
# training.muon_fp32_matmul_prec (torch's float32 matmul precision names, as Megatron-Core uses
# them): highest = fp32 GEMMs; medium = bf16 GEMM operands, fp32 accumulation. ``high`` (TF32 or
# bf16x3 on GPUs) is not built.
MATMUL_PRECISIONS = ("highest", "medium")
EPS = 1e-15   # emerging_optimizers' default: the norm is clamped to at least this


def coefficient_schedule(kind: str, steps: int) -> List[Coeffs]:
    """The ``steps`` coefficient sets of schedule ``kind``."""
    if kind not in COEFFICIENTS:
        raise ValueError(f"training.muon_coefficient_type: {kind!r} is not one of "
                         f"{', '.join(COEFFICIENTS)}")
    sets = COEFFICIENTS[kind]
    base = itertools.chain(sets, itertools.repeat(sets[-1])) if kind in REPEAT_LAST \
        else itertools.cycle(sets)
    return list(itertools.islice(base, steps))


def scale_factor(size_out: int, size_in: int, mode: str) -> float:
    """The update's scale for an ``[out, in]`` matrix (``get_muon_scale_factor``): ``spectral``
    sqrt(max(out, in)); ``shape_scaling`` sqrt(max(1, out/in)) (Keller Jordan's, torch.optim.Muon's
    ``original`` lr adjustment); ``unit_rms_norm`` sqrt(out/in)."""
    if mode == "spectral":
        return max(size_out, size_in) ** 0.5
    if mode == "shape_scaling":
        return max(1.0, size_out / size_in) ** 0.5
    if mode == "unit_rms_norm":
        return (size_out / size_in) ** 0.5
    raise ValueError(f"training.muon_scale_mode: {mode!r} is not one of {', '.join(SCALE_MODES)}")


def check_matmul_precision(prec: str) -> None:
    """Refuse a ``training.muon_fp32_matmul_prec`` this build cannot run, in one line."""
    if prec not in MATMUL_PRECISIONS:
        raise ValueError(f"training.muon_fp32_matmul_prec: {prec!r} is not one of "
                         f"{', '.join(MATMUL_PRECISIONS)} (high, TF32/bf16x3, is not built)")
    if prec == "medium":
        ok, why = bf16_ns_available()
        if not ok:
            raise ValueError(f"training.muon_fp32_matmul_prec medium: the bf16 Newton-Schulz "
                             f"needs the CPU kernel ({why})")


def use_kernel() -> bool:
    """Whether ``newton_schulz`` runs as the one CPU op
    (``ms_llm.ops.cpu_kernels.optimizer.muon_ns``)."""
    return ns_kernel_available()


def newton_schulz(x: Tensor, schedule: Sequence[Coeffs], transpose: Optional[bool] = None,
                  reduce: Optional[Callable[[Tensor], Tensor]] = None,
                  precision: str = "highest", kernel: Optional[bool] = None) -> Tensor:
    """Orthogonalise fp32 ``x`` (``[m, n]``, or a batch ``[k, m, n]`` of matrices).

    ``transpose``: iterate on ``x^T`` (default: when ``x`` has more rows than columns, so the
    Gram matrix is the small one). ``reduce``: a shard of a tensor-parallel matrix
    (``muon_tp``'s ``distributed`` mode): the squared norm and every Gram matrix are summed
    over the shards with it (the shards must split the dimension the Gram sums over).
    ``precision``: ``MATMUL_PRECISIONS`` (``medium`` only through the CPU kernel).
    ``kernel``: False runs the composed form even where the kernel is available (None: use it
    where it is; ``benchmarks/muon.py`` compares the two)."""
    natural = x.shape[-2] > x.shape[-1]
    if transpose is None:
        transpose = natural
    if kernel is None:
        kernel = use_kernel()
    if reduce is None and transpose == natural and (precision == "medium" or kernel):
        return newton_schulz_kernel(x, schedule, EPS, bf16=precision == "medium")
    if precision != "highest":
        raise ValueError(f"training.muon_fp32_matmul_prec {precision}: not built for this "
                         f"Newton-Schulz (tensor-parallel distributed mode or no CPU kernel)")
    if transpose:
        x = x.swapaxes(-2, -1)
    sq = (x * x).sum(dim=(-2, -1), keepdim=True)
    if reduce is not None:
        sq = reduce(sq)
    x = x / mint.clamp(mint.sqrt(sq), min=EPS)
    eye = identity(x.shape[-2])
    for a, b, c in schedule:
        # (a I + b A + c A^2) X as three GEMMs and two small [m, m] passes: the polynomial is
        # built on the Gram side, so the wide X is only ever read by the GEMMs.
        gram = mint.matmul(x, x.swapaxes(-2, -1))
        if reduce is not None:
            gram = reduce(gram)
        if c != 0.0:
            poly = mint.matmul(gram, gram * c + eye * b) + eye * a
        else:
            poly = gram * b + eye * a
        x = mint.matmul(poly, x)
    return x.swapaxes(-2, -1) if transpose else x


@functools.lru_cache(maxsize=32)
def identity(m: int) -> Tensor:
    """The fp32 ``[m, m]`` identity (cached: one per matrix side)."""
    return Tensor(np.eye(m, dtype=np.float32))


def batch_chunks(members: Sequence[int], mats: Sequence[Tensor],
                 limit: int = BATCH_ELEMENTS) -> List[List[int]]:
    """``members`` (aligned with their matrices ``mats``) in consecutive runs of at most
    ``limit`` elements (a lone larger matrix is a run of its own), so a batched Newton-Schulz
    never holds more than a few such buffers at once."""
    runs: List[List[int]] = []
    total = 0
    for j, m in zip(members, mats):
        n = int(m.size)
        if not runs or total + n > limit:
            runs.append([])
            total = 0
        runs[-1].append(j)
        total += n
    return runs
