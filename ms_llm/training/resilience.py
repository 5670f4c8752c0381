"""The trainer's side of fault tolerance, kept out of ``trainer.py``: the non-finite guard's
set-up, the checkpoint's finite check across ranks, the LR schedule a checkpoint records, and the
per-log-interval extras (skipped steps, the slowest rank's step time)."""
from __future__ import annotations

import os
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
from mindspore import Tensor

from ms_llm.config import RunConfig
from .nonfinite import NonFiniteGuard


def publish_rank_status(output_dir: str) -> None:
    """Every rank's watchdog thread publishes its state in ``<output_dir>/.rank_status``, so a
    collective time-out names the stalled peers (``parallel.comm.watchdog``)."""
    from ms_llm.parallel.comm.watchdog import set_status_dir
    set_status_dir(os.path.join(output_dir, ".rank_status"))


def note_step(step: int) -> None:
    from ms_llm.parallel.comm.watchdog import note_step as note
    note(step)


def guard_for(cfg: RunConfig, dist) -> NonFiniteGuard:
    t = cfg.training
    return NonFiniteGuard(t.nan_policy, t.max_skipped_steps, dist.rank, dist.world_size)


def names_of(params: Sequence, named_params: Sequence) -> List[str]:
    """Model names of the optimizer's parameters (its own ``name`` for a shard it made)."""
    by_id = {id(q): n for n, q in named_params}
    return [by_id.get(id(p), getattr(p, "name", f"param{i}")) for i, p in enumerate(params)]


# ----------------------------------------------------------------------------- LR schedule
_SCHEDULE_KEYS = ("lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style",
                  "lr_warmup_init", "lr_warmup_fraction", "train_samples", "lr_warmup_samples",
                  "lr_decay_samples", "lr_wsd_decay_steps", "lr_wsd_decay_samples",
                  "lr_wsd_decay_style")


def lr_schedule(cfg: RunConfig) -> Dict[str, object]:
    """What ``lr_at`` is a function of besides the step (the step itself is saved as ``step``)."""
    t = cfg.training
    out = {k: getattr(t, k) for k in _SCHEDULE_KEYS}
    out["lr_decay_steps"] = t.lr_decay_steps or t.max_steps
    return out


def check_lr_schedule(state: dict, cfg: RunConfig, say: Callable[[str], None]) -> None:
    """The resumed run continues the saved LR schedule: the step comes back exactly, and this says
    when the config changed the schedule itself (e.g. a larger ``training.max_steps`` stretches the
    default decay): the config's schedule is then used from the resumed step on."""
    saved = state.get("lr_schedule")
    if not saved:
        return
    now = lr_schedule(cfg)
    diff = [f"{k} {saved[k]} -> {now[k]}" for k in _SCHEDULE_KEYS
            if k in saved and saved[k] != now[k]]   # (older checkpoints lack the newer keys)
    if diff:
        say(f"resume: the LR schedule differs from the checkpoint's ({', '.join(diff)}); "
            f"continuing with the config's schedule from step {state['step']}")


def restore_scheduler(scheduler, state: dict, cfg: RunConfig) -> None:
    """The scheduler's sample count from the checkpoint (Megatron's ``opt_param_scheduler``
    entry); a checkpoint from before it existed counted one global batch per updated step."""
    saved = state.get("opt_param_scheduler")
    if saved is None:
        done = int(state["step"]) - int(state.get("skipped_steps", 0))
        saved = {"num_steps": done * cfg.training.global_batch_size}
    scheduler.load_state_dict(saved, cfg.training.use_checkpoint_opt_param_scheduler)


# ----------------------------------------------------------------------------- checkpoints
def all_ranks_finite(world: int) -> Callable[[Optional[str]], Optional[str]]:
    """For ``checkpointing.save``: given this rank's first non-finite tensor (or None), the
    description of a non-finite tensor on any rank (or None); one 1-element all-reduce when
    there are several workers, so every rank refuses the save together."""
    def agree(bad: Optional[str]) -> Optional[str]:
        if world == 1:
            return bad
        from ms_llm.parallel import comm
        flag = Tensor(np.array([0.0 if bad is None else 1.0], np.float32))
        comm.all_reduce(flag, group=comm.world_group())
        if bad is None and float(flag.asnumpy()[0]) > 0:
            return "a tensor on another rank (its log names it)"
        return bad
    return agree


def drop_router_counts(model) -> None:
    """Forget the routed-token counts of a skipped step (its expert-bias update is skipped too)."""
    from ms_llm.models.moe import TopKRouter
    for _, cell in model.cells_and_names():
        if isinstance(cell, TopKRouter):
            cell.collect_counts(keep=False)
            cell.local_tokens_per_expert = np.zeros_like(cell.local_tokens_per_expert)


# ----------------------------------------------------------------------------- logging
def slowest_rank(step_time: float, world: int) -> Dict[str, float]:
    """Every worker's step time gathered (one tiny all-gather per logged step): the slowest
    rank and its time, so a straggler shows in the step log."""
    if world == 1:
        return {}
    from mindspore import float32, mint
    from ms_llm.parallel import comm
    mine = Tensor(np.array([step_time], np.float32))
    times = [mint.zeros((1,), dtype=float32) for _ in range(world)]
    comm.all_gather(times, mine, group=comm.world_group())
    values = [float(t.asnumpy()[0]) for t in times]
    r = int(np.argmax(values))
    return {"step_time_max_s": values[r], "slowest_rank": r}


def step_extras(guard: NonFiniteGuard, skipped: bool, step_time: float,
                world: int) -> Dict[str, object]:
    out: Dict[str, object] = slowest_rank(step_time, world)
    if guard.policy == "skip":
        out.update(skipped=bool(skipped), skipped_steps=guard.skipped)
    return out
