"""PyTorch-mirroring shims over MindSpore: the one place that knows which kernel exists where.

Model code imports ``from ms_llm.compat import nn, F`` (and dtypes) instead of ``mindspore.mint``,
so it reads like PyTorch and never special-cases the device. Each function routes to
``mindspore.mint`` where MindSpore 2.10 registers the kernel for the active device and dtype, and
to ``mindspore.ops`` or a composed form where it does not (each route was probed on MindSpore
2.10, and each fallback is tested against NumPy in ``tests/compat/test_compat.py``).

=====================  ==================================  =====================================
torch name             CPU (MindSpore 2.10)                why (CPU failure of the mint route)
=====================  ==================================  =====================================
``full``               ``ops.full`` (bf16: fp32 + cast)    ``mint.full``: FillScalar unregistered
``zeros_like``         ``mint.zeros(x.shape)``             ZerosLikeExt unregistered
``ones_like``          ``mint.ones(x.shape)``              OnesLikeExt unregistered
``full_like``          ``ops.full``                        FullLike unregistered
``arange``             ``ops.arange``                      Arange unregistered (PyNative)
``stack``              ``ops.stack``                       StackExt unregistered
``tril`` / ``triu``    ``ops.tril`` / ``ops.triu``         TrilExt unregistered
``log_softmax``        ``ops.log_softmax``                 LogSoftmaxExt unregistered
``gelu``               ``ops.gelu(approximate="none")``    GeluExt unregistered
``dropout``            ``ops.dropout``                     DropoutExt unregistered
``split``              ``mint.narrow`` pieces              2.10 bug: split+transpose grad wrong
``copy_``              clone the source, then ``copy_``    2.10 bug: copy_ from offset-0 view fails
``clone``              ``x * 1`` (bool: ``Tensor.copy``)   Clone unregistered; Tensor.copy 17x slow
``embedding``          ``ops.gather(W, ids, 0)``           Embedding unregistered; no jit bwd
``argmax``             ``ops.argmax``                      ArgMaxExt unregistered
``topk``               ``ops.topk`` (+ int64 indices)      TopkExt unregistered
``cumsum``             ``ops.cumsum``                      CumsumExt unregistered
``one_hot``            ``ops.one_hot``                     OneHotExt unregistered
``matmul``/``linear``  ``mint`` in fp32, cast back         no bf16 matmul kernel
``softmax``/``exp``/…  ``mint`` in fp32, cast back         no bf16 compute kernels at all
``no_grad``            ``mindspore._no_grad``              no public equivalent (``private_api``)
random init            NumPy, then ``Tensor``              normal_/uniform_ kernels unregistered
=====================  ==================================  =====================================

On Ascend every row takes the ``mint`` route. Fused hot kernels (RMSNorm, SwiGLU, RoPE, attention,
cross entropy) live in ``ms_llm.ops``, which builds on this module. Every private MindSpore API
used anywhere in ms_llm is reached through ``private_api`` (one function each, tested in
``tests/compat/test_private_api.py``).
"""
from mindspore import Parameter, Tensor

from . import functional as F
from . import nn
from .device import DeviceUnavailableError, device, is_ascend, is_cpu, setup_device
from .dtypes import bfloat16, bool_, float16, float32, int32, int64, to_ms_dtype
from .functional import (arange, cat, empty, from_numpy, full, full_like, no_grad, ones,
                         ones_like, stack, tensor, zeros, zeros_like)
from .nn import load_state_dict, manual_seed, state_dict

__all__ = [
    "F", "nn", "Tensor", "Parameter", "device", "is_cpu", "is_ascend", "setup_device",
    "DeviceUnavailableError",
    "float32", "float16", "bfloat16", "int32", "int64", "bool_", "to_ms_dtype",
    "tensor", "from_numpy", "zeros", "ones", "empty", "full", "zeros_like", "ones_like",
    "full_like", "arange", "cat", "stack", "no_grad", "manual_seed", "state_dict",
    "load_state_dict",
]
