"""``torch.autograd.Function`` on MindSpore: ``forward(ctx, ...)``, ``backward(ctx, *grads)``,
``ctx.save_for_backward``, ``Function.apply``.

MindSpore 2.10 ships this as the private ``mindspore.common._Function`` (reached through
``_private.autograd_function_base``); it works in PyNative, where the custom backward runs once
per step, but not inside ``mindspore.jit``. Code that needs a custom backward under jit uses
``ops.Custom(bprop=...)`` or ``Cell.bprop``.
"""
from ._private import autograd_function_base

Function = autograd_function_base()

__all__ = ["Function"]
