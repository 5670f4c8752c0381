"""``torch.autograd.Function`` on MindSpore: ``forward(ctx, ...)``, ``backward(ctx, *grads)``,
``ctx.save_for_backward``, ``Function.apply``.

MindSpore 2.10 ships this as the private ``mindspore.common._Function`` (reached through
``private_api.autograd_function_base``); it works in PyNative, where the custom backward runs once
per step, but not inside ``mindspore.jit``. Code that needs a custom backward under jit uses
``ops.Custom(bprop=...)`` or ``Cell.bprop``.
"""
import contextlib

from .private_api import autograd_function_base

Function = autograd_function_base()

_RECOMPUTING = [False]


def is_recomputing() -> bool:
    """True while a forward runs again only to build its backward: host-side statistics (the
    routers' token counts) must not count the tokens twice."""
    return _RECOMPUTING[0]


@contextlib.contextmanager
def recomputing():
    """The context of a forward that runs again for its backward (see ``is_recomputing``)."""
    before, _RECOMPUTING[0] = _RECOMPUTING[0], True
    try:
        yield
    finally:
        _RECOMPUTING[0] = before


class DeferredVJP:
    """``out = fn(x)`` now, ``(dx, dweights) = backward(dy)`` later, with other forwards and
    backwards in between and the backwards in first-in first-out order (a pipeline's 1F1B).

    MindSpore 2.10 PyNative keeps the backward graphs of pending ``mindspore.vjp`` calls as a
    stack: only the most recent one may run first ("Can not find top cell for backward" for any
    other; ``tests/compat/test_deferred_vjp.py`` shows it). Until that changes, ``backward`` runs
    the forward again under ``vjp`` and its backward at once, so only the input is kept in between
    (the forward costs twice; dropout must draw the same mask, which a zero rate does). Where
    the backwards do come last-in first-out, ``PendingVJP`` keeps the closure instead.
    """

    def __init__(self, fn, x, weights):
        self.fn, self.x, self.weights = fn, x, list(weights)
        self.output = fn(x)
        self._vjp = None

    def prepare(self) -> None:
        """Run the forward again now, keeping its backward closure for ``backward``: a caller
        about to wait for ``dy`` (a pipeline rank waiting for the next stage's gradient) does
        the re-run while it waits. No other ``mindspore.vjp`` may be taken until ``backward``."""
        import mindspore as ms
        if self._vjp is None:
            with recomputing():
                _, self._vjp = ms.vjp(self.fn, self.x, weights=self.weights)
            self.fn = self.x = None

    def backward(self, dy):
        self.prepare()
        vjp, self._vjp = self._vjp, None
        return vjp(dy)


class PendingVJP:
    """``out = fn(x)`` now, ``(dx, dweights) = backward(dy)`` later, through the backward closure
    ``mindspore.vjp`` returns: the forward runs once and its activations stay alive until
    ``backward``. MindSpore 2.10 runs pending closures last-in first-out only, so a caller keeps
    one only when no younger closure is still pending at its ``backward`` (the pipeline plans
    that from its schedule, ``parallel.pipeline.schedules.kept_backwards``), else it uses
    ``DeferredVJP``. Same interface as ``DeferredVJP``."""

    def __init__(self, fn, x, weights):
        import mindspore as ms
        self.output, self._vjp = ms.vjp(fn, x, weights=list(weights))

    def backward(self, dy):
        vjp, self._vjp = self._vjp, None
        return vjp(dy)


__all__ = ["Function", "DeferredVJP", "PendingVJP", "is_recomputing", "recomputing"]
