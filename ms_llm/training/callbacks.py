"""Trainer callbacks: what runs around a training step without being the step.

Fault injection, the watchdog's step bookkeeping and the MoE expert-bias update are callbacks
(``fault_hooks``, ``moe_step``); TensorBoard writers, timers or a new optimizer's bookkeeping
plug in the same way: subclass :class:`TrainerCallback`, override the hooks you need, and
append the instance to ``Trainer.callbacks`` (or pass ``callbacks=[...]`` to ``Trainer``).

Order of the hooks in one step (``step`` is the 1-based step being run)::

    on_step_begin(step)
      on_micro_batch_end(step, i)        # plain executor, after each forward/backward
    grads = on_grads(step, grads)        # reduced fp32 gradients, before the norm
    on_before_update(step)               # after the norm, before the non-finite check
    on_update(step, skipped)             # after the optimizer step (or its skip)
    on_step_end(step, out)               # out: loss, grad_norm, lr, skipped, tokens, metrics
    on_log(step, record)                 # a logged metrics row (log_interval steps only)
    on_eval(step, values) / on_save(step, path)

``on_train_begin(trainer)`` runs once before the first step, ``on_train_end()`` after the last
(also when training raised). Hooks run in list order; a hook that returns a changed gradient
list (``on_grads``) hands it to the next.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional


class TrainerCallback:
    """No-op hooks; override the ones you need."""

    def on_train_begin(self, trainer: Any) -> None:
        pass

    def on_step_begin(self, step: int) -> None:
        pass

    def on_micro_batch_end(self, step: int, index: int) -> None:
        pass

    def on_grads(self, step: int, grads: list) -> list:
        return grads

    def on_before_update(self, step: int) -> None:
        pass

    def on_update(self, step: int, skipped: bool) -> None:
        pass

    def on_step_end(self, step: int, out: Dict[str, Any]) -> None:
        pass

    def on_log(self, step: int, record: Dict[str, Any]) -> None:
        pass

    def on_eval(self, step: int, values: Dict[str, float]) -> None:
        pass

    def on_save(self, step: int, path: str) -> None:
        pass

    def on_train_end(self) -> None:
        pass


class CallbackList(TrainerCallback):
    """Several callbacks called in order, as one."""

    def __init__(self, callbacks: Optional[Iterable[TrainerCallback]] = None):
        self.callbacks: List[TrainerCallback] = list(callbacks or [])

    def append(self, callback: TrainerCallback) -> None:
        if not isinstance(callback, TrainerCallback):
            raise TypeError(f"trainer callbacks subclass TrainerCallback, got "
                            f"{type(callback).__name__}")
        self.callbacks.append(callback)

    def __iter__(self):
        return iter(self.callbacks)

    def __len__(self) -> int:
        return len(self.callbacks)

    def on_train_begin(self, trainer: Any) -> None:
        for c in self.callbacks:
            c.on_train_begin(trainer)

    def on_step_begin(self, step: int) -> None:
        for c in self.callbacks:
            c.on_step_begin(step)

    def on_micro_batch_end(self, step: int, index: int) -> None:
        for c in self.callbacks:
            c.on_micro_batch_end(step, index)

    def on_grads(self, step: int, grads: list) -> list:
        for c in self.callbacks:
            grads = c.on_grads(step, grads)
        return grads

    def on_before_update(self, step: int) -> None:
        for c in self.callbacks:
            c.on_before_update(step)

    def on_update(self, step: int, skipped: bool) -> None:
        for c in self.callbacks:
            c.on_update(step, skipped)

    def on_step_end(self, step: int, out: Dict[str, Any]) -> None:
        for c in self.callbacks:
            c.on_step_end(step, out)

    def on_log(self, step: int, record: Dict[str, Any]) -> None:
        for c in self.callbacks:
            c.on_log(step, record)

    def on_eval(self, step: int, values: Dict[str, float]) -> None:
        for c in self.callbacks:
            c.on_eval(step, values)

    def on_save(self, step: int, path: str) -> None:
        for c in self.callbacks:
            c.on_save(step, path)

    def on_train_end(self) -> None:
        for c in self.callbacks:
            c.on_train_end()
