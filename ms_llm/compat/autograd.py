"""``torch.autograd.Function`` on MindSpore: ``forward(ctx, ...)``, ``backward(ctx, *grads)``,
``ctx.save_for_backward``, ``Function.apply``.

MindSpore 2.10 ships this as the private ``mindspore.common._Function``; it works in PyNative
(custom backward called once per step, verified in the notes) but not inside ``mindspore.jit``.
Code that needs a custom backward under jit uses ``ops.Custom(bprop=...)`` or ``Cell.bprop``.
"""
from mindspore.common import _Function as Function  # noqa: F401  (private in MindSpore 2.10)

__all__ = ["Function"]
