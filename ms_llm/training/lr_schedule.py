"""Megatron's OptimizerParamScheduler shapes: linear warmup, then cosine/linear decay to min_lr;
and the schedule a checkpoint records, checked on resume."""
from __future__ import annotations

import math
from typing import Callable, Dict


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, decay_steps: int,
          style: str = "cosine") -> float:
    """Learning rate for optimizer step ``step`` (1-based, as Megatron counts iterations)."""
    if warmup_steps > 0 and step <= warmup_steps:
        return lr * step / warmup_steps
    if style == "constant":
        return lr
    if step > decay_steps:
        return min_lr
    span = max(decay_steps - warmup_steps, 1)
    ratio = (step - warmup_steps) / span
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:
        raise ValueError(f"training.lr_decay_style: unknown style {style!r}")
    return min_lr + coeff * (lr - min_lr)


_SCHEDULE_KEYS = ("lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style")


def lr_schedule(cfg) -> Dict[str, object]:
    """What ``lr_at`` is a function of besides the step (the step itself is saved as ``step``)."""
    t = cfg.training
    out = {k: getattr(t, k) for k in _SCHEDULE_KEYS}
    out["lr_decay_steps"] = t.lr_decay_steps or t.max_steps
    return out


def check_lr_schedule(state: dict, cfg, say: Callable[[str], None]) -> None:
    """The resumed run continues the saved LR schedule: the step comes back exactly, and this says
    when the config changed the schedule itself (e.g. a larger ``training.max_steps`` stretches the
    default decay): the config's schedule is then used from the resumed step on."""
    saved = state.get("lr_schedule")
    if not saved:
        return
    now = lr_schedule(cfg)
    diff = [f"{k} {saved[k]} -> {now[k]}" for k in _SCHEDULE_KEYS if saved.get(k) != now[k]]
    if diff:
        say(f"resume: the LR schedule differs from the checkpoint's ({', '.join(diff)}); "
            f"continuing with the config's schedule from step {state['step']}")


def lr_for_step(cfg, step: int) -> float:
    """The learning rate of ``step`` under the config's schedule."""
    t = cfg.training
    return lr_at(step, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.lr_warmup_steps,
                 decay_steps=t.lr_decay_steps or t.max_steps, style=t.lr_decay_style)
