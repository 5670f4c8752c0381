"""The learning rate exactly as Megatron-Core's ``OptimizerParamScheduler`` applies it.

Megatron counts the schedule in samples: the scheduler starts at 0 samples, iteration ``i``'s
optimizer step uses the lr of ``(i - 1) * global_batch_size`` samples (so iteration 1 applies
``lr_warmup_init``, 0 by default), and the scheduler then advances by the global batch (only
when the update happened: a skipped step does not advance it). The lr Megatron *prints* on
iteration ``i``'s log line is read after that advance, i.e. iteration ``i + 1``'s; ms-llm logs
the same number so the two logs compare line by line.

Iteration-based runs (``training.max_steps``) convert iterations to samples with the global
batch; sample-based runs (``training.train_samples``) give the ``*_samples`` keys directly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Callable, Dict, Optional

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


@dataclass
class OptimizerParamScheduler:
    """Megatron-Core's scheduler state and formulas (lr part; weight decay is constant here)."""
    max_lr: float
    min_lr: float
    lr_warmup_steps: float          # samples (float under lr_warmup_fraction, as in Megatron)
    lr_decay_steps: int             # samples
    lr_decay_style: str = "cosine"
    init_lr: float = 0.0            # Megatron's --lr-warmup-init
    wsd_decay_steps: Optional[int] = None
    lr_wsd_decay_style: str = "exponential"
    num_steps: int = 0              # samples consumed by successful updates

    def __post_init__(self) -> None:
        if self.lr_decay_style not in DECAY_STYLES:
            raise ValueError(f"training.lr_decay_style: unknown style {self.lr_decay_style!r} "
                             f"(one of {', '.join(DECAY_STYLES)})")
        if self.lr_decay_steps <= 0:
            raise ValueError("training.lr_decay_steps: the decay must span at least one sample")
        # Megatron asserts warmup < decay; here a warmup that outlasts the decay runs the ramp,
        # then min_lr (short test runs keep the default warmup).
        if self.init_lr > self.max_lr:
            raise ValueError(f"training.lr_warmup_init ({self.init_lr}) must be <= training.lr "
                             f"({self.max_lr})")
        if self.lr_decay_style == "WSD" and not self.wsd_decay_steps:
            raise ValueError("training.lr_decay_style WSD needs training.lr_wsd_decay_steps "
                             "(or lr_wsd_decay_samples)")

    def get_lr(self) -> float:
        """The lr at ``num_steps`` samples (Megatron's ``get_lr`` for the default group)."""
        max_lr, min_lr, n = self.max_lr, self.min_lr, self.num_steps
        if self.lr_warmup_steps > 0 and n <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * float(n) / float(self.lr_warmup_steps)
        if self.lr_decay_style == "constant":
            return max_lr
        if n > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            lr = max_lr * max(self.lr_warmup_steps, 1) ** 0.5 / (max(n, 1) ** 0.5)
            return max(min_lr, lr)
        ratio = float(n - self.lr_warmup_steps) / float(self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:   # WSD: constant, then anneal over the last wsd_decay_steps samples
            start = self.lr_decay_steps - self.wsd_decay_steps
            coeff = 1.0 if n <= start else _wsd_coeff(
                self.lr_wsd_decay_style, float(n - start) / float(self.wsd_decay_steps))
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment: int) -> None:
        """Advance by ``increment`` samples (the global batch after a successful update)."""
        self.num_steps += increment

    def state_dict(self) -> dict:
        """Megatron's ``opt_param_scheduler`` checkpoint entry (the keys it reads back)."""
        return {"max_lr": self.max_lr, "lr_warmup_steps": self.lr_warmup_steps,
                "num_steps": self.num_steps, "lr_decay_style": self.lr_decay_style,
                "lr_decay_steps": self.lr_decay_steps, "min_lr": self.min_lr}

    def load_state_dict(self, state: dict, use_checkpoint: bool = False) -> None:
        """Megatron's resume: ``num_steps`` always comes back; the schedule's own values come from
        the checkpoint under ``use_checkpoint`` (``--use-checkpoint-opt_param-scheduler``), else
        the config's stay (Megatron would assert they match; ms-llm reports a difference)."""
        self.num_steps = int(state.get("num_steps", state.get("num_iters", 0)))
        if use_checkpoint:
            for key in ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps",
                        "lr_decay_style"):
                if key in state:
                    setattr(self, key, state[key])


def _wsd_coeff(style: str, ratio: float) -> float:
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        return 2.0 * math.pow(0.5, ratio) - 1.0
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(ratio)
    raise ValueError(f"training.lr_wsd_decay_style: unknown style {style!r} "
                     f"(one of {', '.join(WSD_STYLES)})")


def train_iters(t) -> int:
    """Iterations of the run: ``training.max_steps``, or ``train_samples // global_batch_size``
    for a sample-based run (Megatron's ``update_train_iters`` without batch-size ramp-up)."""
    return t.train_samples // t.global_batch_size if t.train_samples else t.max_steps


def scheduler_from_config(t) -> OptimizerParamScheduler:
    """Megatron's ``get_optimizer_param_scheduler``: every step count in samples.

    ``t`` is the ``training`` section. Iteration-based: ``lr_decay_steps`` (default the run's
    iterations) and ``lr_warmup_steps`` times the global batch, or ``lr_warmup_fraction`` of the
    decay. Sample-based (``train_samples``): ``lr_decay_samples`` (default ``train_samples``) and
    ``lr_warmup_samples`` or the fraction."""
    gbs = t.global_batch_size
    if t.train_samples:
        decay = t.lr_decay_samples or t.train_samples
        warmup = t.lr_warmup_samples
        wsd = t.lr_wsd_decay_samples
    else:
        decay = (t.lr_decay_steps or t.max_steps) * gbs
        warmup = t.lr_warmup_steps * gbs
        wsd = t.lr_wsd_decay_steps * gbs if t.lr_wsd_decay_steps else None
    if t.lr_warmup_fraction is not None:
        warmup = t.lr_warmup_fraction * decay
    return OptimizerParamScheduler(
        max_lr=float(t.lr), min_lr=t.min_lr, lr_warmup_steps=warmup, lr_decay_steps=decay,
        lr_decay_style=t.lr_decay_style, init_lr=t.lr_warmup_init, wsd_decay_steps=wsd,
        lr_wsd_decay_style=t.lr_wsd_decay_style)


SCHEDULE_KEYS = tuple(f.name for f in fields(OptimizerParamScheduler) if f.name != "num_steps")


# ----------------------------------------------------------------------------- resume
_RECORDED = ("lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style",
             "lr_warmup_init", "lr_warmup_fraction", "train_samples", "lr_warmup_samples",
             "lr_decay_samples", "lr_wsd_decay_steps", "lr_wsd_decay_samples",
             "lr_wsd_decay_style")


def lr_schedule(cfg) -> Dict[str, object]:
    """The config keys the schedule is a function of (recorded in a checkpoint; the sample
    count itself is saved as the scheduler's ``num_steps``)."""
    t = cfg.training
    out = {k: getattr(t, k) for k in _RECORDED}
    out["lr_decay_steps"] = t.lr_decay_steps or t.max_steps
    return out


def check_lr_schedule(state: dict, cfg, say: Callable[[str], None]) -> None:
    """The resumed run continues the saved LR schedule: the sample count comes back exactly, and
    this says when the config changed the schedule itself (e.g. a larger ``training.max_steps``
    stretches the default decay): the config's schedule is then used from the resumed step on."""
    saved = state.get("lr_schedule")
    if not saved:
        return
    now = lr_schedule(cfg)
    diff = [f"{k} {saved[k]} -> {now[k]}" for k in _RECORDED
            if k in saved and saved[k] != now[k]]   # (older checkpoints lack the newer keys)
    if diff:
        say(f"resume: the LR schedule differs from the checkpoint's ({', '.join(diff)}); "
            f"continuing with the config's schedule from step {state['step']}")


def restore_scheduler(scheduler: OptimizerParamScheduler, state: dict, cfg) -> None:
    """The scheduler's sample count from the checkpoint (Megatron's ``opt_param_scheduler``
    entry); a checkpoint from before it existed counted one global batch per updated step."""
    saved = state.get("opt_param_scheduler")
    if saved is None:
        done = int(state["step"]) - int(state.get("skipped_steps", 0))
        saved = {"num_steps": done * cfg.training.global_batch_size}
    scheduler.load_state_dict(saved, cfg.training.use_checkpoint_opt_param_scheduler)
