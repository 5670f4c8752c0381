"""Fast fp32 CPU kernels (C++, ``ops.Custom(func_type="aot")``) with AOT backward, built on first use.

    from ms_llm.ops import cpu_kernels as ck
    if ck.available():            # builds once per machine/source version; False with a logged reason
        y = ck.rms_norm(x, w, 1e-6)

Every function also works when ``available()`` is False: it then runs the composed MindSpore form
(:mod:`ms_llm.ops.cpu_kernels.model.composed`). Set ``MS_LLM_DISABLE_AOT=1`` to force that path.

OpenBLAS-backed matmuls live in a separate library that needs the ``scipy-openblas32`` package
(:mod:`ms_llm.ops.cpu_kernels.gemm.blas`):

    if ck.blas_available():       # False (reason logged once) without scipy-openblas32
        y = ck.linear(x, w, b)    # x [..., K], w [N, K], b [N] or None
        s = ck.bmm(q, k, transpose_b=True)
"""

from .gemm.blas import (bmm, blas_threads, causal_attention, linear, linear_fp32, linear_grad,
                        pair_attention, pair_attention_grads, set_blas_threads)
from .build import available, blas_available, blas_library_path, blas_reason, library_path, reason
from .model.functional import (adamw_update, cast_float, causal_softmax, cross_entropy,
                               cross_entropy_grad, cross_entropy_lse, embedding, fork, join_heads,
                               residual_add, rms_norm, rope, split_heads, split_last, swiglu)

__all__ = [
    "available",
    "library_path",
    "reason",
    "rms_norm",
    "swiglu",
    "residual_add",
    "fork",
    "cast_float",
    "adamw_update",
    "embedding",
    "split_last",
    "split_heads",
    "join_heads",
    "cross_entropy",
    "cross_entropy_lse",
    "cross_entropy_grad",
    "linear_grad",
    "linear_fp32",
    "rope",
    "causal_softmax",
    "blas_available",
    "blas_library_path",
    "blas_reason",
    "blas_threads",
    "set_blas_threads",
    "linear",
    "bmm",
    "causal_attention",
    "pair_attention",
    "pair_attention_grads",
]
