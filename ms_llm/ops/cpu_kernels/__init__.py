"""Fast fp32 CPU kernels (C++, ``ops.Custom(func_type="aot")``) with AOT backward, built on first use.

    from ms_llm.ops import cpu_kernels as ck
    if ck.available():            # builds once per machine/source version; False with a logged reason
        y = ck.rms_norm(x, w, 1e-6)

Every function also works when ``available()`` is False: it then runs the composed MindSpore form
(:mod:`ms_llm.ops.cpu_kernels.composed`). Set ``MS_LLM_DISABLE_AOT=1`` to force that path.
"""

from .build import available, library_path, reason
from .functional import causal_softmax, cross_entropy, rms_norm, rope, swiglu

__all__ = [
    "available",
    "library_path",
    "reason",
    "rms_norm",
    "swiglu",
    "cross_entropy",
    "rope",
    "causal_softmax",
]
